"""The consumer planning ahead (consumer/ahead.py) through real Kafka and PostgreSQL, with a
fault in the batch in flight: a write that fails, a fence found by the writer thread, and
a load that fails on the reads' connection. Each run ends with every message audited once
and the index equal to a rebuild from the topic (`kvledger verify`)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kvledger.consumer import ahead as ahead_module
from kvledger.consumer.db import connect
from kvledger.consumer.store.base import FencedError
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.consumer.verify import verify
from tests.helpers.consuming import consume
from tests.helpers.procs import spawn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def backlog(bootstrap: str, topic: str) -> int:
    """A simulated fleet's messages on ``topic`` before any consumer reads it."""
    proc = spawn(
        [sys.executable, "-m", "kvledger.cli", "simulate", "--bootstrap", bootstrap,
         "--topic", topic, "--partitions", "3", "--instances", "3", "--requests", "120",
         "--seed", "9"],
        cwd=ROOT, stdout=-1, stderr=-3, text=True,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("messages:"))
    return int(line.split()[1])


class Fault:
    """Raises ``error`` once, on the ``nth`` call from the writer thread (or, with
    ``writer=False``, from any other), and counts the plans made while a batch was in
    flight."""

    def __init__(self, nth: int, error: Exception, writer: bool = True) -> None:
        self.nth, self.error, self.writer = nth, error, writer
        self.calls = self.raised = self.ahead = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        on_writer = threading.current_thread().name.startswith("kvledger-writer")
        if on_writer != self.writer:
            return
        with self.lock:
            self.calls += 1
            if self.calls == self.nth:
                self.raised += 1
                raise self.error


def run_with(
    monkeypatch: pytest.MonkeyPatch, fault: Fault, where: str, kafka_bootstrap: str,
    fresh_database: str, topic: str, group: str,
) -> None:  # fmt: skip
    produced = backlog(kafka_bootstrap, topic)
    original = getattr(PostgresStore, where)

    def faulty(self: PostgresStore, *args: Any, **kwargs: Any) -> Any:
        fault()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PostgresStore, where, faulty)
    plan = ahead_module.Ahead.plan

    def counted(self: ahead_module.Ahead, *args: Any) -> Any:
        busy = self.busy
        planned = plan(self, *args)
        fault.ahead += busy and planned is not None
        return planned

    monkeypatch.setattr(ahead_module.Ahead, "plan", counted)
    summary = consume(kafka_bootstrap, fresh_database, topic, group, batch=150)
    assert fault.raised == 1 and fault.ahead > 5
    assert summary.messages == produced
    with connect(fresh_database, autocommit=True) as conn:
        (events,) = conn.execute("SELECT count(*) FROM kvledger.events").fetchone()  # type: ignore[misc]
    assert events == produced  # each message once
    result = verify(kafka_bootstrap, fresh_database, topic, group)
    assert result.ok, [(d.table, d.only_live[:2], d.only_rebuilt[:2]) for d in result.differences]


@pytest.mark.parametrize(
    ("where", "fault"),
    [
        ("write", lambda: Fault(4, psycopg.OperationalError("injected: the write failed"))),
        ("fence", lambda: Fault(5, FencedError({0: (0, 1)}))),
        ("load", lambda: Fault(6, psycopg.OperationalError("injected: the load failed"),
                               writer=False)),
    ],
    ids=["write fails", "fenced in flight", "load fails"],
)  # fmt: skip
def test_a_fault_in_flight_loses_nothing_and_applies_nothing_twice(
    where: str, fault: Any, monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str,
    fresh_database: str, make_topic: Any, group_id: str,
) -> None:  # fmt: skip
    run_with(monkeypatch, fault(), where, kafka_bootstrap, fresh_database,
             make_topic("ahead", partitions=3), group_id)  # fmt: skip
