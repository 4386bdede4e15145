"""docker-compose.yml parses and agrees with the code: services, images, variables, commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvledger.arguments import ENV_READER_PASSWORD as ENV_PASSWORD
from kvledger.cli import build_parser
from kvledger.settings import ENV_DATABASE, ENV_KAFKA, ENV_LOOKUP_DATABASE

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_services_and_images() -> None:
    services = _compose()["services"]
    assert set(services) == {
        "kafka", "postgres", "postgres-standby", "migrate", "consumer", "lookup", "relay",
    }  # fmt: skip
    assert services["postgres-standby"]["profiles"] == ["standby"]  # only when asked
    script = "./deploy/compose/primary-replication.sh"
    assert any(v.startswith(script + ":") for v in services["postgres"]["volumes"])
    assert (ROOT / script).stat().st_mode & 0o111  # the postgres image runs it
    assert services["relay"]["profiles"] == ["relay"]  # only with an engine to relay
    kafka_image = services["kafka"]["image"]
    assert kafka_image.startswith("apache/kafka:4.")
    assert services["postgres"]["image"].startswith("postgres:")
    assert "KRaft" in (ROOT / "docker-compose.yml").read_text()
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    for name in ("kafka", "postgres", "lookup"):
        assert "healthcheck" in services[name], name
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def _commands(service: dict[str, Any]) -> list[list[str]]:
    """The kvledger command lines of a service (a `sh -c "a && b"` one split at &&)."""
    command = service["command"]
    if command[:2] == ["sh", "-c"]:
        return [part.split() for part in command[2].split("&&")]
    return [command]


def test_app_services_use_the_codes_variables_and_commands() -> None:
    services = _compose()["services"]
    parser = build_parser()
    expected = {
        "migrate": {ENV_KAFKA, ENV_DATABASE, ENV_PASSWORD},
        "consumer": {ENV_KAFKA, ENV_DATABASE},
        "lookup": {ENV_LOOKUP_DATABASE},  # the read-only login, not the owner
    }
    for name, variables in expected.items():
        service = services[name]
        env = service["environment"]
        assert set(env) == variables, name
        for key in variables & {ENV_DATABASE, ENV_LOOKUP_DATABASE}:
            assert env[key].startswith("postgresql+psycopg://")
        for command in _commands(service):
            assert command[0] == "kvledger"
            parser.parse_args(command[1:])  # exits (fails the test) on an unknown flag
    reader = ["kvledger", "roles", "create-reader", "kvledger_lookup", "--reset-password"]
    assert reader in _commands(services["migrate"])
    assert "kvledger_lookup:" in services["lookup"]["environment"][ENV_LOOKUP_DATABASE]
    relay = services["relay"]
    assert set(relay["environment"]) == {ENV_KAFKA}
    assert relay["command"][:2] == ["kvledger", "relay"]
    parser.parse_args(relay["command"][1:])
    assert services["consumer"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )


def test_host_ports_match_scripts_services() -> None:
    services = _compose()["services"]
    script = (ROOT / "scripts" / "services").read_text()
    kafka = "127.0.0.1:${KVLEDGER_KAFKA_PORT:-19092}:${KVLEDGER_KAFKA_PORT:-19092}"
    assert kafka in services["kafka"]["ports"]
    assert "127.0.0.1:${KVLEDGER_PG_PORT:-15432}:5432" in services["postgres"]["ports"]
    assert "KVLEDGER_KAFKA_PORT:-19092" in script and "KVLEDGER_PG_PORT:-15432" in script


def test_no_password_is_written_in_the_file() -> None:
    """Every password comes from the environment, and compose refuses to start without it."""
    services = _compose()["services"]
    urls = [
        services["migrate"]["environment"][ENV_DATABASE],
        services["lookup"]["environment"][ENV_LOOKUP_DATABASE],
    ]
    secrets = [
        services["postgres"]["environment"]["POSTGRES_PASSWORD"],
        services["migrate"]["environment"][ENV_PASSWORD],
    ]
    for url in urls:
        password = url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
        secrets.append(password)
    for value in secrets:
        assert value.startswith("${") and ":?" in value, value
    # The standby's: compose reads it even when the profile is off, so it may not be `:?`;
    # the standby refuses to start without it instead.
    standby = services["postgres-standby"]
    assert standby["environment"]["PGPASSWORD"] == "${KVLEDGER_REPLICATOR_PASSWORD:-}"
    assert '[ -n "$$PGPASSWORD" ] ||' in standby["command"][2]


def test_one_version_of_each_service_everywhere() -> None:
    """scripts/services (Kafka jars by deploy/kafka/pom.xml, the machine's PostgreSQL: Debian
    bookworm's 15), the test images (the same jars, bookworm's postgresql), docker-compose.yml
    and the testcontainers defaults name the same Kafka release and PostgreSQL major."""
    import re

    pom = (ROOT / "deploy" / "kafka" / "pom.xml").read_text()
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", pom)
    assert match is not None
    kafka = match.group(1)
    services = _compose()["services"]
    assert services["kafka"]["image"] == f"apache/kafka:{kafka}"
    assert services["postgres"]["image"] == "postgres:15"
    assert services["postgres-standby"]["image"] == "postgres:15"
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert f'"apache/kafka:{kafka}"' in conftest and '"postgres:15"' in conftest
    for image in ("kafka", "postgres"):
        containerfile = (ROOT / "deploy" / "containers" / image / "Containerfile").read_text()
        assert "FROM debian:bookworm" in containerfile  # bookworm's postgresql is 15
