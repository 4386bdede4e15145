"""docker-compose.yml parses and agrees with the code: services, images, variables, commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvledger.cli import build_parser
from kvledger.settings import ENV_DATABASE, ENV_KAFKA

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_services_and_images() -> None:
    services = _compose()["services"]
    assert set(services) == {"kafka", "postgres", "migrate", "consumer", "lookup", "relay"}
    assert services["relay"]["profiles"] == ["relay"]  # only with an engine to relay
    kafka_image = services["kafka"]["image"]
    assert kafka_image.startswith("apache/kafka:4.")
    assert services["postgres"]["image"] == "postgres:16"
    assert "KRaft" in (ROOT / "docker-compose.yml").read_text()
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    for name in ("kafka", "postgres", "lookup"):
        assert "healthcheck" in services[name], name
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_app_services_use_the_codes_variables_and_commands() -> None:
    services = _compose()["services"]
    parser = build_parser()
    for name in ("migrate", "consumer", "lookup"):
        service = services[name]
        env = service["environment"]
        assert set(env) == {ENV_KAFKA, ENV_DATABASE}, name
        assert env[ENV_DATABASE].startswith("postgresql+psycopg://")
        command = service["command"]
        assert command[0] == "kvledger"
        parser.parse_args(command[1:])  # exits (fails the test) on an unknown flag
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
