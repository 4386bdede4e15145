"""Shared helpers for benchmarks: timing and the results file."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results.json"


def rate(count: int, fn: Callable[[], object], repeat: int = 3) -> float:
    """Best-of-``repeat`` items per second of ``fn`` processing ``count`` items."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return count / best


def record(name: str, figures: dict[str, Any]) -> None:
    """Merge one benchmark's figures into bench/results.json and print them."""
    data: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[name] = figures
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"== {name}")
    for key, value in figures.items():
        shown = f"{value:,.2f}" if isinstance(value, float) else str(value)
        print(f"   {key:<40} {shown}")


def settle(database_url: str, timeout_s: float = 60.0) -> None:
    """Wait (up to ``timeout_s``) until no autovacuum worker runs on the server, so that one
    benchmark's clean-up (an earlier run's dead rows) does not land in the next one's timings."""
    from kvledger.consumer.db import connect

    deadline = time.monotonic() + timeout_s
    with connect(database_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
            ).fetchone()
            if not row or row[0] == 0:
                return
            time.sleep(0.5)
