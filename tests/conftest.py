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


def _services_env() -> dict[str, str]:
    """Start scripts/services (idempotent) and return the variables it prints."""
    subprocess.run([str(ROOT / "scripts" / "services"), "up"], check=True)
    out = subprocess.run(
        [str(ROOT / "scripts" / "services"), "env"], check=True, capture_output=True, text=True
    ).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value
    return env


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap servers of a real Apache Kafka broker."""
    if value := os.environ.get("KVLEDGER_KAFKA_BOOTSTRAP"):
        yield value
        return
    if _docker_engine_answers():
        from testcontainers.community.kafka import KafkaContainer

        try:
            image = os.environ.get("KVLEDGER_TEST_KAFKA_IMAGE", "confluentinc/cp-kafka:7.7.1")
            container = KafkaContainer(image).with_kraft()
            container.start()
        except Exception as exc:
            _unavailable("Kafka (testcontainers)", repr(exc))
        try:
            yield container.get_bootstrap_server()
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

        try:
            image = os.environ.get("KVLEDGER_TEST_POSTGRES_IMAGE", "postgres:16")
            container = PostgresContainer(image, driver="psycopg")
            container.start()
        except Exception as exc:
            _unavailable("PostgreSQL (testcontainers)", repr(exc))
        try:
            yield container.get_connection_url()
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
    from tests.procs import reap

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


@pytest.fixture
def fresh_database(database_url: str) -> Iterator[str]:
    """A new, migrated database for one test (dropped afterwards); yields its URL."""
    import sqlalchemy as sa

    from consumer.db import connect, migrate

    name = f"kvl_test_{uuid.uuid4().hex[:12]}"
    with connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(database_url).set(database=name).render_as_string(hide_password=False)
    migrate(url)
    try:
        yield url
    finally:
        with connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
