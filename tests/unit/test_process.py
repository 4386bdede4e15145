"""kvledger/process.py: the long-running commands' collector settings; the consumer's GIL
switch interval while it plans ahead (consumer/ahead.py), and how often it reports its
progress (consumer/service.py)."""

from __future__ import annotations

import gc
import sys
from typing import cast

import pytest

from kvledger.consumer.ahead import SWITCH_INTERVAL_S, Ahead
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.process import SERVER_COLLECTION, collect_less_often


def test_a_server_collects_in_larger_rarer_passes() -> None:
    before = gc.get_threshold()
    try:
        collect_less_often()
        assert gc.get_threshold() == SERVER_COLLECTION
        # Rarer than Python's default young passes (700; compared with the constant: a
        # command run in this process, as some tests do, may have set the thresholds).
        assert SERVER_COLLECTION[0] > 700
    finally:
        gc.set_threshold(*before)


def test_planning_ahead_trades_the_gil_often_while_open_and_gives_the_interval_back() -> None:
    """The consumer's writer thread waits for the GIL after each round trip to PostgreSQL:
    while batches are planned ahead the interval is short, and afterwards what it was."""
    before = sys.getswitchinterval()
    ahead = Ahead(cast(PostgresStore, None), "group")
    try:
        assert before > SWITCH_INTERVAL_S
        assert abs(sys.getswitchinterval() - SWITCH_INTERVAL_S) < 1e-9
    finally:
        ahead.close()
    assert sys.getswitchinterval() == before


def test_a_consumer_reports_its_progress_and_reads_its_lag_at_most_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading the lag asks the broker and the index: not between every two batches."""
    from kvledger.consumer import service
    from kvledger.consumer.config import ConsumerConfig
    from kvledger.consumer.core.model import Plan
    from kvledger.consumer.pipeline import BatchResult

    reports: list[int] = []
    consumer = service.IndexConsumer(
        ConsumerConfig("127.0.0.1:1", "postgresql://nowhere/none"),
        progress=lambda summary, lag: reports.append(summary.batches),
    )
    lags: list[int] = []
    monkeypatch.setattr(consumer, "lag", lambda: lags.append(1) or 7)
    clock = [100.0]
    monkeypatch.setattr(service.time, "monotonic", lambda: clock[0])
    for _ in range(3):  # three batches within the same second: the first is reported
        consumer._account(BatchResult(Plan()))
    clock[0] += service.PROGRESS_INTERVAL_S
    consumer._account(BatchResult(Plan()))
    assert reports == [1, 4] and len(lags) == 2  # every batch counted, two reports
