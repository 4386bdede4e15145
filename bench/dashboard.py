"""The dashboard on a large index: how long its data takes, and what its polling costs the
consumer.

1. An index built by the apply path from a simulated fleet (8 instances; ``--requests``
   sets its size: 9,100 make about a million block rows and 1.7 million history rows).
2. The page's first paint in Debian's chromium (tests/helpers/browser.py), opened at
   ``/ui`` on that index: the first contentful paint, and the page drawn with its data
   (its charts and tables filled; polled every 50 ms), both from navigation start.
3. ``GET /v1/dashboard`` through `kvledger serve` (the page's one data request; the page
   and its scripts are static files), computed afresh (five windows, p50 and worst) and
   shared (asked again within the page's refresh: the service computes a window's data
   at most once every 5 s, whatever the number of viewers), beside a full count of the
   history table on the same server (the baseline: one scan of it).
4. The apply rate of the stream's last fifth (the index is built from the rest), in four
   parts, quiet, polled, polled, quiet (polled: while `kvledger serve` is asked for the
   dashboard's data every second, five open tabs' worth; the order cancels the slowing of
   an index that grows as it goes), and the ratio polled / quiet.

`python -m bench.dashboard` runs it alone (bench/results/dashboard/); `make bench` runs it
with the rest.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time

import httpx

from bench.common import PUBLISHED, lookup_service, publish, reader_args, record, settle
from bench.consume import _database, _messages
from kvledger.consumer.ahead import apply_in_turn
from kvledger.consumer.db import connect, drop_database
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.fleet import FleetConfig
from kvledger.process import collect_less_often, freeze_startup_objects
from kvledger.schemas.codec import Codec
from tests.helpers.browser import chromium, missing

NAME = "kvledger_bench_dashboard"


def _apply(url: str, messages: list[tuple[bytes, bytes]], source: str, first: int = 0) -> int:
    """Apply ``messages`` in batches of 5,000 as the consumer does (each planned while the
    one before it is written: consumer/ahead.py); the block events applied."""
    inbound = [Inbound(source, 0, first + i, k, v) for i, (k, v) in enumerate(messages)]
    batches = (inbound[i : i + 5000] for i in range(0, len(inbound), 5000))
    with connect(url, autocommit=True) as conn, connect(url, autocommit=True) as reads:
        results = apply_in_turn(batches, Codec(), PostgresStore(conn), PostgresStore(reads),
                                "bench")  # fmt: skip
        return sum(r.plan.block_events for r in results)


def run(server: str, requests: int) -> dict[str, float]:
    url = _database(server, NAME)
    threshold = gc.get_threshold()
    try:
        freeze_startup_objects()  # and collect, as `kvledger consume` does
        collect_less_often()
        messages = _messages(FleetConfig(instances=8, requests=requests, seed=5))
        built = len(messages) * 4 // 5  # the rest: the apply beside the dashboard
        _apply(url, messages[:built], "bench")
        with connect(url, autocommit=True) as conn:
            blocks = conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone()
            history = conn.execute("SELECT count(*) FROM kvledger.residency_history").fetchone()
            assert blocks is not None and history is not None
            scans = []
            for _ in range(5):
                start = time.perf_counter()
                conn.execute("SELECT count(*) FROM kvledger.residency_history").fetchone()
                scans.append(time.perf_counter() - start)
        settle(url)
        figures: dict[str, float] = {"blocks": float(blocks[0]), "history rows": float(history[0])}
        with lookup_service(reader_args(url)) as base:
            figures.update(_first_paint(base))  # before anything asked for its window
            fresh, shared = [], []
            for minutes in (56, 57, 58, 59, 60):  # a window not asked yet: computed
                start = time.perf_counter()
                r = httpx.get(f"{base}/v1/dashboard?minutes={minutes}", timeout=60)
                fresh.append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
                start = time.perf_counter()
                httpx.get(f"{base}/v1/dashboard?minutes={minutes}", timeout=60)
                shared.append(time.perf_counter() - start)
            figures["GET /v1/dashboard s, computed, p50 of 5"] = statistics.median(fresh)
            figures["GET /v1/dashboard s, computed, worst of 5"] = max(fresh)
            figures["GET /v1/dashboard s, shared within a refresh, p50 of 5"] = statistics.median(
                shared
            )
            figures["baseline: count(*) of the history, s, p50 of 5"] = statistics.median(scans)
            figures.update(_apply_beside_polling(url, base, messages[built:], built))
        return figures
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)  # the rest of `make bench` as it was
        drop_database(server, NAME)


def _first_paint(base: str) -> dict[str, float]:
    """The page's first contentful paint and its drawing with data, in seconds from
    navigation start (see the module docstring)."""
    if (why := missing()) is not None:
        raise RuntimeError(f"the first paint needs a browser: {why}")
    with chromium() as driver:
        driver.get(f"{base}/ui")
        drawn = ("return window.kvledgerDashboard && window.kvledgerDashboard.state.last "
                 "? performance.now() : null")  # fmt: skip
        deadline = time.monotonic() + 60
        while (at := driver.execute_script(drawn)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not draw within 60 s")
            time.sleep(0.05)
        paint = driver.execute_script(
            "const p = performance.getEntriesByName('first-contentful-paint');"
            "return p.length ? p[0].startTime : null;"
        )
    return {
        "page's first contentful paint, s": float(paint or 0) / 1000,
        "page drawn with its data, s": float(at) / 1000,
    }


def _apply_beside_polling(
    url: str, base: str, messages: list[tuple[bytes, bytes]], first: int
) -> dict[str, float]:
    """The stream's last messages applied in four parts: quiet, polled, polled, quiet."""
    quarter = len(messages) // 4
    parts = [messages[i * quarter : (i + 1) * quarter] for i in range(4)]
    rates: dict[bool, list[float]] = {False: [], True: []}
    polls = [0]
    for k, part in enumerate(parts):
        polled = k in (1, 2)
        stop = threading.Event()

        def poll(stop: threading.Event = stop) -> None:
            while not stop.wait(1.0):  # the service answers in its own process, as deployed
                httpx.get(f"{base}/v1/dashboard", timeout=60).raise_for_status()
                polls[0] += 1

        thread = threading.Thread(target=poll, daemon=True) if polled else None
        if thread is not None:
            thread.start()
        start = time.perf_counter()
        events = _apply(url, part, "bench", first=first + k * quarter)
        rates[polled].append(events / (time.perf_counter() - start))
        stop.set()
        if thread is not None:
            thread.join()
    quiet, polled_rate = statistics.mean(rates[False]), statistics.mean(rates[True])
    return {
        "apply block-events/s, quiet": quiet,
        "apply block-events/s, dashboard asked every second": polled_rate,
        "ratio polled / quiet": polled_rate / quiet,
        "dashboard answers during the polled parts": float(polls[0]),
    }


def main(requests: int = 9100) -> dict[str, float]:
    server = os.environ["KVLEDGER_DATABASE_URL"]
    settle(server)
    figures = run(server, requests)
    record("dashboard", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__)
    parser.add_argument("--requests", type=int, default=9100)
    args = parser.parse_args()
    written = publish({"dashboard": main(args.requests)}, PUBLISHED / "dashboard",
                      command="python -m bench.dashboard")  # fmt: skip
    print(f"wrote {', '.join(str(p) for p in written)}")
