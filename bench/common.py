"""Shared helpers for benchmarks: timing and the results file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results.json"  # this run's, while it runs
PUBLISHED = Path(__file__).resolve().parent / "results"  # each run's, dated, checked in


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


def publish(
    data: dict[str, dict[str, Any]],
    folder: Path = PUBLISHED,
    when: datetime | None = None,
    command: str = "make bench",
) -> list[Path]:
    """Write one run's figures (of ``command``) as ``<date>.json`` and ``<date>.md`` (a
    table per benchmark) in ``folder``; returns the paths written (no copy as "latest":
    the newest date is the newest run)."""
    when = when or datetime.now(UTC)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = f"{when:%Y-%m-%d}"
    meta = {"date": f"{when:%Y-%m-%dT%H:%M:%SZ}", "machine": _machine()}
    as_json = folder / f"{stamp}.json"
    as_json.write_text(json.dumps({"run": meta, **data}, indent=2, sort_keys=True) + "\n")
    lines = [
        f"# Benchmark results, {stamp}",
        "",
        f"`{command}` on {meta['machine']}, {meta['date']}. Each figure sits beside the "
        "baseline measured in the same run (this machine is noisy: compare ratios). The "
        f"same figures as JSON: [{as_json.name}]({as_json.name}).",
    ]
    for name, figures in data.items():
        lines += ["", f"## {name}", "", "| figure | value |", "| --- | --- |"]
        for key, value in figures.items():
            shown = f"{value:,.2f}" if isinstance(value, float) else f"{value:,}" if (
                isinstance(value, int) and not isinstance(value, bool)
            ) else str(value)  # fmt: skip
            lines.append(f"| {key} | {shown} |")
    table = "\n".join(lines) + "\n"
    as_md = folder / f"{stamp}.md"
    as_md.write_text(table)
    return [as_json, as_md]


def _machine() -> str:
    cores = os.cpu_count() or 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = int(f.readline().split()[1])
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        memory = ""
    return f"{platform.machine()}, {cores} cores{memory}, Python {platform.python_version()}"


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


def reader_args(url: str) -> list[str]:
    """`kvledger serve` arguments for database ``url`` as the read-only login
    ($KVLEDGER_LOOKUP_DATABASE_URL's role, as scripts/services makes it); without one, the
    owner's URL with --allow-writer."""
    import os

    import sqlalchemy as sa

    reader = os.environ.get("KVLEDGER_LOOKUP_DATABASE_URL")
    if not reader:
        return ["--database-url", url, "--allow-writer"]
    name = sa.engine.make_url(url).database
    as_reader = sa.engine.make_url(reader).set(database=name)
    return ["--database-url", as_reader.render_as_string(hide_password=False)]


@contextmanager
def lookup_service(args: list[str], start_timeout_s: float = 30.0) -> Iterator[str]:
    """A `kvledger serve` process on a free loopback port; yields its base URL once
    /healthz answers, and stops it afterwards."""
    with lookup_services([args], start_timeout_s) as bases:
        yield bases[0]


@contextmanager
def lookup_services(many: list[list[str]], start_timeout_s: float = 30.0) -> Iterator[list[str]]:
    """Several `kvledger serve` processes started together; yields their base URLs once each
    /healthz answers, and stops them afterwards."""
    import socket
    import subprocess
    import sys

    import httpx

    servers, bases = [], []
    try:
        for args in many:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            servers.append(subprocess.Popen(
                [sys.executable, "-m", "kvledger.cli", "serve", *args, "--port", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
            bases.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + start_timeout_s
        for base, args in zip(bases, many, strict=True):
            while True:
                try:
                    if httpx.get(f"{base}/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvledger serve {' '.join(args)} did not start")
                time.sleep(0.2)
        yield bases
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(30)


def percentiles_ms(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(samples)
    return (
        statistics.median(ordered) * 1000,
        ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
    )


def post_times(base: str, bodies: list[dict[str, Any]], warm: int = 200) -> list[float]:
    """Seconds per POST /v1/match, one client, after ``warm`` untimed requests."""
    import httpx

    times = []
    with httpx.Client(base_url=base) as client:
        for body in bodies[:warm]:
            client.post("/v1/match", json=body)
        for body in bodies:
            start = time.perf_counter()
            response = client.post("/v1/match", json=body)
            times.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
    return times


def client_times(base: str, prompts: list[list[bytes]], warm: int = 200) -> list[float]:
    """Seconds per lookup through kvledger.client.LookupClient (the project's own client:
    standard library, keep-alive), one client, after ``warm`` untimed requests."""
    from kvledger.client import LookupClient

    times = []
    with LookupClient(base) as client:
        for p in prompts[:warm]:
            client.match("bench", p)
        for p in prompts:
            start = time.perf_counter()
            client.match("bench", p)
            times.append(time.perf_counter() - start)
    return times


def capture_produced(publisher: Any, captured: list[tuple[bytes, bytes]]) -> None:
    """Route a KVEventPublisher's produce() calls through a recorder of (key, value), so that
    a raw baseline can send the very same bytes."""
    inner = publisher._producer

    class _Capturing:
        def produce(self, topic: str, value: bytes, key: bytes) -> None:
            captured.append((key, value))
            inner.produce(topic, value, key)

        def __len__(self) -> int:  # what is still queued (not a name __getattr__ serves)
            return len(inner)

        def __getattr__(self, name: str) -> object:
            return getattr(inner, name)

    publisher._producer = publisher._stream.producer = _Capturing()


def raw_produce(
    bootstrap: str,
    topic: str,
    messages: list[tuple[bytes, bytes]],
    warm: bool = False,
    partition_of: Callable[[bytes], int] | None = None,
) -> float:
    """Seconds for one producer with the publisher's settings to produce ``messages``
    (key, value) to ``topic`` and have every one acknowledged (the raw baseline).

    ``partition_of``: each key's partition (else the publisher's partitioner places it).

    ``warm``: the producer starts before the clock does (one message produced and
    acknowledged: metadata fetched, the idempotent producer's id granted, ~0.5 s here), as
    a path compared with it that started before its clock did; else that start is timed."""
    from confluent_kafka import Producer

    from kvledger.producer.config import PRODUCER_DEFAULTS

    producer = Producer(dict(PRODUCER_DEFAULTS, **{"bootstrap.servers": bootstrap}))
    if warm and messages:
        producer.produce(topic, value=messages[0][1], key=messages[0][0])
        if producer.flush(60):
            raise RuntimeError(f"the raw baseline could not start on {topic}")
    start = time.perf_counter()
    for key, value in messages:
        while True:
            try:
                if partition_of is None:
                    producer.produce(topic, value=value, key=key)
                else:
                    producer.produce(topic, value=value, key=key, partition=partition_of(key))
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(120):
        raise RuntimeError(f"the raw baseline left messages unacknowledged on {topic}")
    return time.perf_counter() - start
