"""A dashboard flood beside the lookups: `POST /v1/match` while 300 clients each ask
`GET /v1/dashboard` for a window of their own, beside the same lookups quiet, in one run.

An index built by the apply path from a simulated fleet (8 instances; ``--requests`` sets
its size), one `kvledger serve` on it (SQL mode, the read-only login). An honest client asks
`/v1/match` for one of the fleet's prompts on a kept-alive connection, first quiet for
``QUIET_S``, then while 300 threads each ask the dashboard's data for a different ``minutes``
(1 to 300: no two share a window, so no answer is shared by asking), from a process of
its own. Figures: the lookups'
p50 and p99 quiet and during the flood and their ratio (target: p99 during <= 2x quiet),
how the 300 dashboard requests ended (200, 503) and how long the flood took.

`python -m bench.dashboard_flood` runs it alone (bench/results/dashboard-flood/).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import statistics
import threading
import time
import urllib.parse
from typing import Any

from bench.common import PUBLISHED, lookup_service, publish, reader_args, record, settle
from bench.consume import _database, _messages
from bench.dashboard import _apply
from bench.http_attack import lookups_while
from kvledger.consumer.db import drop_database
from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts

NAME = "kvledger_bench_dashboard_flood"
QUIET_S = 10.0
FLOOD = 300


def _match_body(fleet: FleetConfig) -> bytes:
    prompt = system_prompts(fleet)[0] + [1, 2, 3]
    hashes = [h.hex() for h in prompt_hashes(prompt, fleet, int64=False)]
    return json.dumps({"model": fleet.model, "hashes": hashes, "include_silent": True}).encode()


def _lookups(base: str, body: bytes, until: threading.Event | float) -> list[float]:
    """Seconds each `/v1/match` took, asked one after another until ``until`` (a time on the
    monotonic clock, or an event); a failure counts as the time it took."""

    def going() -> bool:
        if isinstance(until, threading.Event):
            return not until.is_set()
        return time.monotonic() < until

    port = urllib.parse.urlsplit(base).port
    assert port is not None
    return lookups_while(port, body, going, timeout=120)


def _flood(base: str) -> tuple[dict[int, int], float]:
    """300 dashboard requests at once, each its own window: their statuses, and the seconds
    until the last ended."""
    url = urllib.parse.urlsplit(base)
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    gate = threading.Barrier(FLOOD)

    def ask(minutes: int) -> None:
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=300)
        gate.wait()
        try:
            conn.request("GET", f"/v1/dashboard?minutes={minutes}")
            status = conn.getresponse().status
        except (OSError, http.client.HTTPException):
            status = 0
        finally:
            conn.close()
        with lock:
            statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=ask, args=(m,)) for m in range(1, FLOOD + 1)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses, time.monotonic() - started


def _flood_into(base: str, out: Any) -> None:
    out.put(_flood(base))


def _flood_elsewhere(base: str) -> tuple[dict[int, int], float]:
    """:func:`_flood` from a process of its own: its 300 threads do not take the honest
    client's interpreter (as an attacker elsewhere would not)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_flood_into, args=(base, out))
    proc.start()
    result: tuple[dict[int, int], float] = out.get(timeout=600)
    proc.join(60)
    return result


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main(requests: int = 400) -> dict[str, float | str]:
    server = os.environ["KVLEDGER_DATABASE_URL"]
    url = _database(server, NAME)
    try:
        fleet = FleetConfig(instances=8, requests=requests, seed=5)
        _apply(url, _messages(fleet), "bench")
        settle(url)
        body = _match_body(fleet)
        with lookup_service(reader_args(url)) as base:
            _lookups(base, body, time.monotonic() + 2.0)  # warm: the pool's connections
            quiet = _lookups(base, body, time.monotonic() + QUIET_S)
            done = threading.Event()
            during: list[float] = []
            honest = threading.Thread(target=lambda: during.extend(_lookups(base, body, done)))
            honest.start()
            time.sleep(0.5)
            statuses, flood_s = _flood_elsewhere(base)
            done.set()
            honest.join()
    finally:
        drop_database(server, NAME)
    figures: dict[str, float | str] = {
        "fleet requests (8 instances)": float(requests),
        "POST /v1/match ms, quiet, p50": _p(quiet, 50) * 1000,
        "POST /v1/match ms, quiet, p99": _p(quiet, 99) * 1000,
        "POST /v1/match ms, during the flood, p50": _p(during, 50) * 1000,
        "POST /v1/match ms, during the flood, p99": _p(during, 99) * 1000,
        "POST /v1/match during / quiet, p99 (target <= 2)": _p(during, 99) / _p(quiet, 99),
        "lookups asked quiet / during": f"{len(quiet)} / {len(during)}",
        "GET /v1/dashboard statuses of 300": ", ".join(
            f"{s}: {n}" for s, n in sorted(statuses.items())
        ),
        "the flood's 300 requests answered within, s": flood_s,
    }
    record("dashboard-flood", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard_flood", description=__doc__)
    parser.add_argument("--requests", type=int, default=400, help="fleet requests (index size)")
    args = parser.parse_args()
    written = publish(
        {"dashboard-flood": main(args.requests)},
        PUBLISHED / "dashboard-flood",
        command="python -m bench.dashboard_flood",
    )
    print(f"wrote {', '.join(str(w) for w in written)}")
