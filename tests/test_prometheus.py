"""Prometheus as its users run it: a real server (Debian's) scrapes the consumer, the lookup
service and the relay, and PromQL returns the counts the index holds; the alert rules pass
promtool's check and their unit tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvledger.consumer.db import connect
from kvledger.vllm_engine import ZmqEngine, stored
from tests.helpers.consuming import wait_caught_up
from tests.helpers.procs import first_answer, free_port, reap, spawn
from tests.helpers.prometheus import ensure_prometheus, prometheus_server

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus"


def test_the_alert_rules_check_and_pass_their_unit_tests() -> None:
    _, promtool = ensure_prometheus()
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run(
            [promtool, *args], cwd=RULES, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 4 rules found" in subprocess.run(
        [promtool, "check", "rules", "alerts.yml"], cwd=RULES, capture_output=True, text=True,
        check=False,
    ).stdout  # fmt: skip


def _wait(what: str, probe: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def _kvledger(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvledger", *args]


def test_prometheus_scrapes_the_consumer_the_lookup_service_and_the_relay(
    kafka_bootstrap: str, fresh_database: str, as_reader, make_topic, group_id: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    topic = make_topic("prom", partitions=3)
    # A stock engine's stream through the relay, and a simulated fleet with one source that
    # sends what the index must reject.
    engine = ZmqEngine(free_port(), free_port())
    ports = {name: free_port() for name in ("consumer", "lookup", "relay")}
    try:
        spawn(_kvledger(
            "relay", "--endpoint", engine.endpoint, "--replay-endpoint", engine.replay_endpoint,
            "--source", "prom-engine", "--model", "prom-model", "--group", "0:full_attention:4",
            "--topic", topic, "--bootstrap", kafka_bootstrap, "--heartbeat-interval", "0",
            "--metrics-port", str(ports["relay"]),
        ), stdout=subprocess.DEVNULL, stderr=(tmp_path / "relay.log").open("w"))  # fmt: skip
        metrics = first_answer(f"http://127.0.0.1:{ports['relay']}/metrics", "the relay", 90)
        assert metrics.status_code == 200
        time.sleep(1)  # its subscription settles (a PUB drops what comes before)
        batches = 6
        for i in range(batches):
            engine.publish([stored([1000 + i], None, [i, i + 1, i + 2, i + 3], 4)])
        done = subprocess.run(
            _kvledger("simulate", "--bootstrap", kafka_bootstrap, "--topic", topic,
                      "--requests", "12", "--seed", "4", "--misconfigured-source",
                      "--partitions", "3"),
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        spawn(_kvledger(
            "consume", "--bootstrap", kafka_bootstrap, "--database-url", fresh_database,
            "--topic", topic, "--consumer-group", group_id, "--dlq-topic", f"{topic}.dlq",
            "--no-migrate", "--metrics-port", str(ports["consumer"]),
        ), stdout=subprocess.DEVNULL, stderr=(tmp_path / "consumer.log").open("w"))  # fmt: skip
        spawn(_kvledger(
            "serve", "--database-url", as_reader(fresh_database), "--port", str(ports["lookup"]),
        ), stdout=subprocess.DEVNULL, stderr=(tmp_path / "lookup.log").open("w"))  # fmt: skip
        metrics = first_answer(f"http://127.0.0.1:{ports['lookup']}/metrics", "the lookup", 90)
        assert metrics.status_code == 200
        _wait("the relayed batches in the index", lambda: _relayed(fresh_database) == batches)
        wait_caught_up(kafka_bootstrap, fresh_database, topic, group_id)
        lookups = 3
        for _ in range(lookups):
            body = {"model": "prom-model", "hashes": [(1000).to_bytes(8, "big").hex()]}
            answer = httpx.post(f"http://127.0.0.1:{ports['lookup']}/v1/match", json=body)
            assert answer.status_code == 200, answer.text
        with connect(fresh_database, autocommit=True) as conn:
            applied = conn.execute(
                "SELECT count(*) FROM kvledger.events WHERE status = 'applied'"
            ).fetchone()
            rejected = conn.execute("SELECT count(*) FROM kvledger.rejected_events").fetchone()
        assert applied is not None and rejected is not None and rejected[0] > 0

        targets = {job: f"127.0.0.1:{port}" for job, port in ports.items()}
        with prometheus_server(targets, tmp_path / "prometheus") as prom:
            prom.wait_for("sum(up)", 3)
            prom.wait_for('sum(kvledger_messages_applied_total{job="consumer"})', applied[0])
            prom.wait_for('sum(kvledger_messages_rejected_total{job="consumer"})', rejected[0])
            prom.wait_for('sum(kvledger_consumer_lag_messages{job="consumer"})', 0)
            prom.wait_for(
                'sum(kvledger_http_requests_total{job="lookup",route="match",status="200"})',
                lookups,
            )
            prom.wait_for(
                'sum(kvledger_http_request_duration_seconds_count{job="lookup",route="match"})',
                lookups,
            )
            # The buckets resolve sub-millisecond lookups.
            assert prom.query('kvledger_http_request_duration_seconds_bucket{le="0.00025"}')
            received = prom.value('sum(kvledger_relay_batches_received_total{job="relay"})')
            assert received is not None and received >= batches
            prom.wait_for('sum(kvledger_relay_unrecoverable_gaps_total{job="relay"})', 0)
            for job in ports:  # the process's own metrics, as on the default registry
                assert prom.value(f'process_resident_memory_bytes{{job="{job}"}}'), job
    finally:
        reap()  # the services' sessions end before the database is dropped
        engine.close()


def _relayed(db: str) -> int:
    with connect(db, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM kvledger.events WHERE source = 'prom-engine' "
            "AND event_type = 'BlockStored'"
        ).fetchone()
    return int(row[0]) if row else 0
