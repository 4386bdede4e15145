"""docker-compose.yml for real, through podman-compose and the images built here.

Runs in `make test-containers` (which sets up the engine and the images); the main run
leaves this folder out. The stack's Kafka, PostgreSQL, migration job and lookup service come
up; `kvledger simulate` and `kvledger consume --until-caught-up` run against it from the
host; the lookup service answers; the stack goes down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from kvledger.consumer.db import connect
from kvledger.fleet import FleetConfig, system_prompts
from tests.helpers.procs import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{args[:3]}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _wait_for_services(bootstrap: str, database: str, timeout: float = 180) -> None:
    import psycopg
    from confluent_kafka.admin import AdminClient

    from kvledger.consumer.db import conninfo

    deadline = time.monotonic() + timeout
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    while True:
        try:
            with psycopg.connect(conninfo(database), connect_timeout=2):
                pass
            if admin.list_topics(timeout=2).brokers:
                return
        except Exception:
            pass
        assert time.monotonic() < deadline, "the compose Kafka/PostgreSQL never answered"
        time.sleep(1)


def test_compose_stack_end_to_end() -> None:
    if not os.environ.get("KVLEDGER_APP_IMAGE"):
        pytest.fail("run through `make test-containers` (it builds the images)", pytrace=False)
    ports = {
        "KVLEDGER_KAFKA_PORT": free_port(),
        "KVLEDGER_PG_PORT": free_port(),
        "KVLEDGER_LOOKUP_PORT": free_port(),
        "KVLEDGER_METRICS_PORT": free_port(),
    }
    secrets = {
        "KVLEDGER_PG_PASSWORD": uuid.uuid4().hex,
        "KVLEDGER_READER_PASSWORD": uuid.uuid4().hex,
    }
    env = dict(os.environ, **{k: str(v) for k, v in ports.items()}, **secrets)
    project = f"kvledger-ci-{uuid.uuid4().hex[:6]}"
    compose = [
        sys.executable, "-m", "podman_compose", "-p", project,
        "-f", "docker-compose.yml", "-f", "deploy/containers/compose.podman.yml",
    ]  # fmt: skip
    bootstrap = f"127.0.0.1:{ports['KVLEDGER_KAFKA_PORT']}"
    database = (
        f"postgresql+psycopg://kvledger:{secrets['KVLEDGER_PG_PASSWORD']}"
        f"@127.0.0.1:{ports['KVLEDGER_PG_PORT']}/kvledger"
    )
    try:
        # Podman 4.3 honours neither `condition: service_healthy` nor dependencies on a
        # finished one-shot container: bring the stack up in its order by hand.
        _run([*compose, "up", "-d", "kafka", "postgres"], env, timeout=600)
        _wait_for_services(bootstrap, database)
        with connect(database, autocommit=True) as conn:  # the compose command's settings
            assert conn.execute("SHOW shared_buffers").fetchone() == ("512MB",)
        _run([*compose, "run", "--rm", "migrate"], env)
        _run([*compose, "up", "-d", "--no-deps", "lookup"], env)
        lookup = f"http://127.0.0.1:{ports['KVLEDGER_LOOKUP_PORT']}"
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{lookup}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the compose lookup service never got healthy"
            time.sleep(1)
        cli = [sys.executable, "-m", "kvledger.cli"]
        out = _run(
            [*cli, "simulate", "--bootstrap", bootstrap, "--requests", "30", "--seed", "3"], env
        )
        assert "acknowledged" in out
        out = _run(
            [*cli, "consume", "--bootstrap", bootstrap, "--database-url", database,
             "--until-caught-up", "--no-migrate"],
            env,
        )  # fmt: skip
        assert "applied" in out
        prompt = system_prompts(FleetConfig(requests=30, seed=3))[0]
        answer = httpx.post(
            f"{lookup}/v1/match",
            # The simulated engines stopped publishing: a window that outlasts the test.
            json={"model": "sim-llama-8b", "token_ids": prompt, "silent_after_s": 3600},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        holders = answer.json()["holders"]
        assert holders and all(h["instance"].startswith("engine-") for h in holders)
    finally:
        subprocess.run(
            [*compose, "down", "-t", "5"], cwd=ROOT, env=env, capture_output=True, check=False
        )
