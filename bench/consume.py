"""Materialization rate, beside a raw COPY of the same rows; end-to-end lag at a steady rate.

1. apply: a simulated fleet's messages (pre-encoded, as on the topic) go through decode +
   validate + apply + offsets in batches of 5,000, one transaction each, into a fresh
   database; figure: block events (hashes stored or removed) per second. Twice: one batch
   at a time (``run_batch``), and as the consumer runs by default, each batch planned while
   the one before it is written (consumer/ahead.py), into a second database.
2. baselines: the rows the first run wrote (blocks, residencies, history, audit log) are
   COPYed into an empty copy of the same tables in the same database server, as a client
   holding them as values would (psycopg's write_row: the baseline of earlier results),
   and as binary COPY data encoded beforehand (what PostgreSQL alone takes). Planning
   ahead and both COPYs are measured three times, each figure the median; the ratios
   compare the apply rates with the baselines for the same number of block events.
3. lag: a producer publishes at a steady 5,000 messages/s while the consumer runs; lag per
   message = the time its audit row was written minus its event time (p50, p99).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import psycopg
from confluent_kafka.admin import AdminClient

from bench.common import PUBLISHED, publish, record, settle
from kvledger.consumer.ahead import apply_in_turn
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect, create_database, migrate
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.pipeline import run_batch
from kvledger.consumer.service import IndexConsumer
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.fleet import Fleet, FleetConfig
from kvledger.process import collect_less_often, freeze_startup_objects
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import Envelope
from kvledger.schemas.topics import ensure_topic
from kvledger.sinks import CollectingSink

TABLES = ("blocks", "residencies", "residency_history", "events")


def _database(server: str, name: str) -> str:
    url = create_database(server, name, replace=True)
    migrate(url)
    return url


def _messages(fleet: FleetConfig) -> list[tuple[bytes, bytes]]:
    """(key, value) of every message the fleet publishes, in publish order."""
    sinks: dict[str, CollectingSink] = {}

    def sink(instance: str) -> CollectingSink:
        sinks[instance] = CollectingSink(fleet.model)
        return sinks[instance]

    Fleet(fleet, sink).run()
    codec = Codec()
    out = []
    for source, s in sinks.items():
        seq: dict[int, int] = {}
        for i, event in enumerate(s.events):
            group = event.group_idx or 0
            n = seq.get(group, 0)
            seq[group] = n + 1
            env = Envelope(source, fleet.model, 0, 1, n, 1_764_000_000_000 + i, event)
            out.append((f"{source}/{group}".encode(), codec.encode(env)))
    return out


def _applied_ahead(
    url: str, inbound: list[Inbound], batch_size: int
) -> tuple[float, int, list[int]]:
    """(seconds, block events, rows per table) of applying ``inbound`` planning ahead."""
    batches = (inbound[i : i + batch_size] for i in range(0, len(inbound), batch_size))
    with connect(url, autocommit=True) as conn, connect(url, autocommit=True) as reads:
        start = time.perf_counter()
        block_events = sum(r.plan.block_events for r in apply_in_turn(
            batches, Codec(), PostgresStore(conn), PostgresStore(reads), "bench"))  # fmt: skip
        seconds = time.perf_counter() - start
        counts = [conn.execute(f"SELECT count(*) FROM kvledger.{t}").fetchone() for t in TABLES]
    return seconds, block_events, [int(c[0]) for c in counts if c is not None]


def apply_rate(
    server: str, fleet: FleetConfig, batch_size: int = 5000, runs: int = 3
) -> dict[str, float]:
    messages = _messages(fleet)
    url = _database(server, "kvledger_bench_apply")
    codec = Codec()
    inbound = [Inbound("bench", 0, i, k, v) for i, (k, v) in enumerate(messages)]
    # A consumer holds one batch, not the whole topic: keep the pre-encoded messages out of
    # the collector's scans, as `kvledger consume` does with what start-up loaded, and
    # collect as it does.
    threshold = gc.get_threshold()
    freeze_startup_objects()
    collect_less_often()
    block_events = 0
    ahead_runs = [
        _applied_ahead(_database(server, "kvledger_bench_apply_ahead"), inbound, batch_size)
        for _ in range(runs)
    ]
    with connect(url, autocommit=True) as conn:
        store = PostgresStore(conn)
        start = time.perf_counter()
        for i in range(0, len(inbound), batch_size):
            result = run_batch(inbound[i : i + batch_size], codec, store, "bench")
            block_events += result.plan.block_events
        seconds = time.perf_counter() - start
        rows = {t: conn.execute(f"SELECT * FROM kvledger.{t}").fetchall() for t in TABLES}
        for _, ahead_events, ahead_counts in ahead_runs:
            assert ahead_events == block_events, (ahead_events, block_events)
            assert ahead_counts == [len(rows[t]) for t in TABLES]  # the same rows
        copy_seconds = _median([_copy_rows(conn, rows) for _ in range(runs)])
        binary_seconds = _median([_copy_binary(conn) for _ in range(runs)])
        conn.execute("DROP SCHEMA copy_bench CASCADE")
    gc.unfreeze()
    gc.set_threshold(*threshold)  # the rest of `make bench` as it was
    ours = block_events / seconds
    ahead = block_events / _median([secs for secs, _, _ in ahead_runs])
    raw, binary = block_events / copy_seconds, block_events / binary_seconds
    return {
        "messages": float(len(messages)),
        "block events": float(block_events),
        "rows written": float(sum(len(r) for r in rows.values())),
        "apply block-events/s (decode+validate+apply+offsets)": ours,
        f"apply planning ahead, block-events/s (median of {runs})": ahead,
        f"raw COPY of the same rows, block-events/s (median of {runs})": raw,
        f"binary COPY of the same rows, encoded beforehand (median of {runs})": binary,
        "ratio apply / raw COPY": ours / raw,
        "ratio apply planning ahead / raw COPY": ahead / raw,
        "ratio apply planning ahead / binary COPY": ahead / binary,
    }


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _empty_copies(conn: psycopg.Connection) -> dict[str, list[str]]:
    """Empty copies of the written tables (copy_bench.*), and each one's columns."""
    conn.execute("CREATE SCHEMA IF NOT EXISTS copy_bench")
    columns = {}
    for t in TABLES:
        conn.execute(f"DROP TABLE IF EXISTS copy_bench.{t}")
        conn.execute(f"CREATE TABLE copy_bench.{t} (LIKE kvledger.{t} INCLUDING ALL)")
        described = conn.execute(f"SELECT * FROM kvledger.{t} LIMIT 0").description or []
        columns[t] = [d.name for d in described]
    return columns


def _copy_rows(conn: psycopg.Connection, rows: dict[str, list[tuple[object, ...]]]) -> float:
    """Seconds to COPY the rows, as a client holding them as values would (psycopg's
    write_row, which formats each value as text)."""
    columns = _empty_copies(conn)
    start = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur:
        for t in TABLES:
            with cur.copy(f"COPY copy_bench.{t} ({', '.join(columns[t])}) FROM STDIN") as copy:
                for row in rows[t]:
                    copy.write_row(row)
    return time.perf_counter() - start


def _copy_binary(conn: psycopg.Connection) -> float:
    """Seconds to COPY the rows as binary COPY data read back from the tables beforehand:
    what PostgreSQL alone takes to store them (the client does no work per row)."""
    columns = _empty_copies(conn)
    data = {}
    for t in TABLES:
        names = ", ".join(columns[t])
        with conn.cursor().copy(
            f"COPY (SELECT {names} FROM kvledger.{t}) TO STDOUT (FORMAT BINARY)"
        ) as copy:
            data[t] = b"".join(bytes(block) for block in copy)
    start = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur:
        for t in TABLES:
            names = ", ".join(columns[t])
            with cur.copy(f"COPY copy_bench.{t} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.write(data[t])
    return time.perf_counter() - start


def lag(
    bootstrap: str, server: str, rate: float = 5000.0, seconds: float = 12.0
) -> dict[str, float]:
    """A producer process publishes at ``rate`` messages/s; the consumer runs here."""
    url = _database(server, "kvledger_bench_lag")
    topic = f"bench-lag-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    ensure_topic(admin, topic, 12)
    consumer = IndexConsumer(
        ConsumerConfig(
            bootstrap,
            url,
            topic=topic,
            group_id="bench-lag",
            dlq_topic=f"{topic}.dlq",
            batch_size=5000,
            batch_timeout_s=0.05,
        )
    )
    threshold = gc.get_threshold()
    freeze_startup_objects()  # as `kvledger consume` does
    collect_less_often()
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    time.sleep(3)  # group join
    # About 20 messages per request: enough requests for ``seconds`` at ``rate``.
    requests = int(rate * seconds / 20 / 4)
    producer = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "simulate", "--bootstrap", bootstrap,
         "--topic", topic, "--partitions", "12", "--instances", "4",
         "--requests", str(requests), "--rate", str(rate), "--seed", "3"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    produced = int(re.search(r"(\d+) produced", producer.stdout).group(1))  # type: ignore[union-attr]
    elapsed = float(re.search(r"elapsed: +([\d.]+) s", producer.stdout).group(1))  # type: ignore[union-attr]
    deadline = time.monotonic() + 120
    while consumer.summary.messages < produced and time.monotonic() < deadline:
        time.sleep(0.2)
    consumer.stop()
    thread.join(30)
    gc.unfreeze()
    gc.set_threshold(*threshold)  # the rest of `make bench` as it was
    with connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), "
            "percentile_cont(0.99) WITHIN GROUP (ORDER BY d), count(*) "
            "FROM (SELECT extract(epoch FROM applied_at - event_time) * 1000 AS d "
            "FROM kvledger.events) s"
        ).fetchone()
        assert row is not None
        p50, p99, n = row
    admin.delete_topics([topic, f"{topic}.dlq"])
    return {
        "target msg/s": rate,
        "achieved msg/s": produced / elapsed,
        "block events/s (about 3 per message)": consumer.summary.block_events / elapsed,
        "messages measured": float(n),
        "lag p50 ms": float(p50),
        "lag p99 ms": float(p99),
    }


def main() -> dict[str, dict[str, float]]:
    server = os.environ["KVLEDGER_DATABASE_URL"]
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    out = {}
    settle(server)
    out["consume_apply"] = apply_rate(server, FleetConfig(instances=4, requests=500, seed=21))
    record("consume_apply", out["consume_apply"])
    # At 5,000 msg/s the producer, broker, database and consumer share this 2-core machine;
    # the lower rate shows the lag with headroom.
    for rate in (5000, 3000):
        settle(server)
        out[f"consume_lag_{rate}"] = lag(bootstrap, server, rate=float(rate))
        record(f"consume_lag_{rate}", out[f"consume_lag_{rate}"])
    return out


if __name__ == "__main__":
    written = publish(main(), PUBLISHED / "consume", command="python -m bench.consume")
    print(f"wrote {', '.join(str(w) for w in written)}")
