"""Shared fixtures: real Kafka and PostgreSQL for integration tests.

Where the services come from, in order:
1. ``KVLEDGER_KAFKA_BOOTSTRAP`` / ``KVLEDGER_DATABASE_URL`` when set (``make test`` sets them
   from ``scripts/services env``; point them at any existing broker and server);
2. testcontainers, when a Docker engine answers;
3. ``scripts/services up`` (real Kafka from Maven Central jars, PostgreSQL from the machine).

With ``CI=true`` an integration test that cannot get its service fails; it never skips.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
# A user's ~/.config/kvledger/config.toml never reaches the tests' commands (an empty file
# instead); a test of the file names its own.
os.environ.setdefault("KVLEDGER_CONFIG", os.devnull)
# Nor does a schema registry that `scripts/services env` exported (it does while the registry
# runs): every command would use it. tests/test_schema_registry.py asks scripts/services.
for _name in ("KVLEDGER_SCHEMA_REGISTRY", "KVLEDGER_SCHEMA_REGISTRY_CONFIG"):
    os.environ.pop(_name, None)
    os.environ.pop(f"{_name}_FILE", None)
os.environ.pop("KVLEDGER_SUBJECT_STRATEGY", None)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse a run aimed at services off this machine unless told it may use them."""
    from tests.helpers.local_only import ALLOW, remote_services

    remote = remote_services(os.environ)
    if remote and os.environ.get(ALLOW) != "1":
        pytest.exit(
            f"the tests would create and drop topics, groups and databases on services off "
            f"this machine ({', '.join(remote)}): set {ALLOW}=1 to allow it",
            returncode=2,
        )


def _unavailable(what: str, why: str) -> None:
    message = f"{what} is not available: {why}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False


_STARTED: dict[str, str] = {}  # what scripts/services printed, once this run started it


def _services_env() -> dict[str, str]:
    """Start scripts/services (idempotent) and return the variables it prints."""
    if _STARTED:
        return _STARTED
    subprocess.run([str(ROOT / "scripts" / "services"), "up"], check=True)
    out = subprocess.run(
        [str(ROOT / "scripts" / "services"), "env"], check=True, capture_output=True, text=True
    ).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value
    _STARTED.update(env)
    return env


def _kafka_container(image: str) -> tuple[Any, str]:
    """A single-node KRaft broker; its listener port is published as the same host port, so
    the address it advertises (127.0.0.1:<port>) works from the host."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    from tests.helpers.procs import free_port

    port = free_port()
    container = DockerContainer(image).with_bind_ports(port, port)
    if "kvledger-kafka" in image:  # the image scripts/containers builds
        container = container.with_env("KAFKA_PORT", str(port))
    else:  # apache/kafka
        for key, value in {
            "KAFKA_NODE_ID": "1",
            "KAFKA_PROCESS_ROLES": "broker,controller",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
            "KAFKA_LISTENERS": f"PLAINTEXT://:{port},CONTROLLER://:9093",
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
            "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
            "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
            "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        }.items():
            container = container.with_env(key, value)
    container.waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(120))
    container.start()
    return container, f"127.0.0.1:{port}"


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap servers of a real Apache Kafka broker."""
    if value := os.environ.get("KVLEDGER_KAFKA_BOOTSTRAP"):
        yield value
        return
    if _docker_engine_answers():
        image = os.environ.get("KVLEDGER_TEST_KAFKA_IMAGE", "apache/kafka:4.3.1")
        container = None
        try:
            container, bootstrap = _kafka_container(image)
        except Exception as exc:
            if container is not None:
                container.stop()
            _unavailable("Kafka (testcontainers)", repr(exc))
        try:
            yield bootstrap
        finally:
            container.stop()
        return
    try:
        yield _services_env()["KVLEDGER_KAFKA_BOOTSTRAP"]
    except (subprocess.CalledProcessError, KeyError, OSError) as exc:
        _unavailable("Kafka (scripts/services)", repr(exc))


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """SQLAlchemy URL (postgresql+psycopg://) of a real PostgreSQL server."""
    if value := os.environ.get("KVLEDGER_DATABASE_URL"):
        yield value
        return
    if _docker_engine_answers():
        from testcontainers.community.postgres import PostgresContainer

        image = os.environ.get("KVLEDGER_TEST_POSTGRES_IMAGE", "postgres:15")
        container = None
        try:  # DockerException is raised at construction when the engine goes away
            container = PostgresContainer(
                image, username="kvledger", password="kvledger", dbname="kvledger", driver="psycopg"
            )
            container.start()
        except Exception as exc:
            if container is not None:
                container.stop()
            _unavailable("PostgreSQL (testcontainers)", repr(exc))
        try:
            yield container.get_connection_url().replace("localhost", "127.0.0.1")
        finally:
            container.stop()
        return
    try:
        yield _services_env()["KVLEDGER_DATABASE_URL"]
    except (subprocess.CalledProcessError, KeyError, OSError) as exc:
        _unavailable("PostgreSQL (scripts/services)", repr(exc))


@pytest.fixture(autouse=True)
def _reap_children() -> Iterator[None]:
    """Kill any child process a test left running (e.g. after a failed assertion)."""
    from tests.helpers.procs import reap

    yield
    reap()


@pytest.fixture
def kafka_admin(kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture
def make_topic(kafka_admin: AdminClient) -> Iterator[Callable[..., str]]:
    """Create uuid-suffixed topics for one test; they are deleted afterwards."""
    created: list[str] = []

    def create(prefix: str = "test", partitions: int = 3, **config: Any) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = kafka_admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config)]
        )
        futures[name].result(timeout=30)
        created.append(name)
        return name

    yield create
    if created:
        for future in kafka_admin.delete_topics(created).values():
            with contextlib.suppress(Exception):
                future.result(timeout=30)


@pytest.fixture
def group_id() -> str:
    """A consumer group of this test alone."""
    return f"test-group-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def as_reader(database_url: str) -> Callable[[str], str]:
    """``as_reader(url)``: the URL of the same database for the read-only login the lookup
    service uses ($KVLEDGER_LOOKUP_DATABASE_URL's role, which scripts/services makes; else
    one made here with the server's URL as the admin)."""
    import sqlalchemy as sa

    reader = os.environ.get("KVLEDGER_LOOKUP_DATABASE_URL")
    if not reader and _STARTED.get("KVLEDGER_DATABASE_URL") == database_url:
        reader = _STARTED.get("KVLEDGER_LOOKUP_DATABASE_URL")
    if reader and sa.engine.make_url(reader).port != sa.engine.make_url(database_url).port:
        reader = None  # another server's (e.g. a testcontainer's database_url)
    if not reader:
        from kvledger.consumer.roles import create_reader

        password = uuid.uuid4().hex
        create_reader(
            database_url, database_url, password, "kvledger_test_lookup", reset_password=True
        )
        reader = (
            sa.engine.make_url(database_url)
            .set(username="kvledger_test_lookup", password=password)
            .render_as_string(hide_password=False)
        )
    reader_url = sa.engine.make_url(reader)

    def convert(url: str) -> str:
        given = sa.engine.make_url(url)  # its database and session options, the reader's login
        as_reader = reader_url.set(database=given.database, query=given.query)
        return as_reader.render_as_string(hide_password=False)

    return convert


@pytest.fixture
def fresh_database(database_url: str) -> Iterator[str]:
    """A new, migrated database for one test (dropped afterwards); yields its URL."""
    from kvledger.consumer.db import create_database, drop_database, migrate

    name = f"kvl_test_{uuid.uuid4().hex[:12]}"
    url = create_database(database_url, name)
    migrate(url)
    try:
        yield url
    finally:
        drop_database(database_url, name)


@pytest.fixture
def vllm_kv_events(request: pytest.FixtureRequest) -> Iterator[Any]:
    """vLLM's kv_events module from its wheel (see tests/helpers/vllm_wheel.py): 0.33.0's,
    or the version a test names (``parametrize("vllm_kv_events", [...], indirect=True)``)."""
    from tests.helpers.vllm_wheel import VERSION, vllm_module

    with vllm_module("vllm.distributed.kv_events", getattr(request, "param", VERSION)) as module:
        yield module
