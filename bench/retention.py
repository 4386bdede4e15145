"""Retention soak: the schema's size under a steady fleet, with retention beside without.

Two indexes side by side in one run, each fed its own copy of the same steady fleet (four
simulated engines serving the same prompts again and again, each round a restart: the live
index stays the same size) at the same message rate, each built by its own `kvledger
consume` process:

- **retention**: partitions of 30 s, history, audit and blocks kept 2 minutes, a retention
  pass every 15 s;
- **baseline**: the defaults (partitions of a day, a week's retention: nothing expires
  within the run).

Every 30 s the schema's size (every table, partition, index and TOAST table of schema
``kvledger``) is sampled for both. Figures: the middle and last samples of each and their
ratio (target with retention: last <= 1.15 x middle; the baseline grows linearly), and each
consumer's apply rate (messages per second of batch time, from its own metrics; target:
retention >= 0.9 x baseline). Run with ``python -m bench.retention [minutes]`` (services up;
10 minutes by default); `make bench` runs it too.

``python -m bench.retention --soak [ROUNDS]`` is the long run of the retention arm alone: a
round is one fleet run (four engines, 40 requests each, a restart each time) at 2,000
messages per second, about 2 s; 800 rounds by default (about half an hour). Round 100 comes
after the retained window first fills (2 minutes, a 30 s partition and a 15 s pass): the
size there is the plateau's. The schema's size is sampled every 2 s beside the round count.
The figure: the mean size over the last 50 rounds beside the mean over rounds 100 to 150
(target: at most 1.10; a partition is dropped every 30 s, so each window spans three or more
of the saw's teeth). Beside it, each table's share (partitions counted under their parent,
indexes and TOAST included) and its dead rows at round 100 and at the end, to name whatever
grows. It writes bench/results/retention-soak/<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from bench.common import PUBLISHED, publish, record
from kvledger.consumer.db import connect, create_database, drop_database, migrate
from kvledger.consumer.retention import set_partition_interval
from kvledger.consumer.retention_policy import parse_duration
from kvledger.fleet import FleetConfig
from kvledger.schemas.topics import ensure_topic
from kvledger.simulate_cmd import run_simulation

SAMPLE_S = 30.0
ARMS = {
    "retention": ["--history-retention", "2m", "--audit-retention", "2m",
                  "--block-retention", "2m", "--retention-every", "15"],
    "baseline": [],
}  # fmt: skip

_SIZE = """
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'kvledger' AND c.relkind IN ('r', 'm')
"""


# Each table's total size (its partitions, indexes and TOAST under it) and its row counts.
_TABLES = """
SELECT coalesce(parent.relname, c.relname), sum(pg_total_relation_size(c.oid)),
       coalesce(sum(s.n_live_tup), 0), coalesce(sum(s.n_dead_tup), 0)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'kvledger'
LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
LEFT JOIN pg_class parent ON parent.oid = i.inhparent
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.relkind IN ('r', 'm') GROUP BY 1
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        found = re.match(rf"{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if found:
            total += float(found.group(2))
    return total


def _schema_bytes(url: str) -> int:
    with connect(url, autocommit=True) as conn:
        row = conn.execute(_SIZE).fetchone()
    return int(row[0]) if row else 0


def _publish(bootstrap: str, topic: str, rate: float, until: float, counts: dict[str, int],
             arm: str) -> None:  # fmt: skip
    """The same fleet again and again (same seed: the same prompts), paced to ``rate``."""
    while time.monotonic() < until:
        fleet = FleetConfig(instances=4, requests=40, seed=17)
        sim = run_simulation(bootstrap, topic, fleet, partitions=12, show_progress=False,
                             rate=rate)  # fmt: skip
        counts[arm] = counts.get(arm, 0) + sim.produced


def main(minutes: float = 10.0, rate: float = 250.0) -> dict[str, float | str]:
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    server = os.environ["KVLEDGER_DATABASE_URL"]
    base = sa.engine.make_url(server).database
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    urls, topics, ports, procs = {}, {}, {}, {}
    for arm, flags in ARMS.items():
        urls[arm] = create_database(server, f"{base}_soak_{arm}", replace=True)
        migrate(urls[arm])
        if arm == "retention":
            with connect(urls[arm], autocommit=True) as conn:
                set_partition_interval(conn, parse_duration("30s"))
        topics[arm] = f"soak-{arm}-{uuid.uuid4().hex[:8]}"
        ensure_topic(admin, topics[arm], 12)
        ports[arm] = _free_port()
        procs[arm] = subprocess.Popen(
            [sys.executable, "-m", "kvledger.cli", "consume", "--bootstrap", bootstrap,
             "--database-url", urls[arm], "--topic", topics[arm], "--consumer-group",
             f"soak-{arm}", "--no-migrate", "--dlq-topic", f"{topics[arm]}.dlq",
             "--metrics-port", str(ports[arm]), *flags],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
    until = time.monotonic() + minutes * 60
    counts: dict[str, int] = {}
    publishers = [
        threading.Thread(target=_publish, args=(bootstrap, topics[arm], rate, until, counts, arm))
        for arm in ARMS
    ]
    for t in publishers:
        t.start()
    samples: dict[str, list[int]] = {arm: [] for arm in ARMS}
    started = time.monotonic()
    while time.monotonic() < until:
        time.sleep(max(0.0, started + SAMPLE_S * (len(samples["baseline"]) + 1) - time.monotonic()))
        for arm in ARMS:
            samples[arm].append(_schema_bytes(urls[arm]))
        print(
            f"  {time.monotonic() - started:5.0f} s: "
            + ", ".join(f"{arm} {samples[arm][-1] / 2**20:7.1f} MiB" for arm in ARMS),
            flush=True,
        )
    for t in publishers:
        t.join()
    applied = {}
    for arm in ARMS:
        seconds = _metric(ports[arm], "kvledger_batch_duration_seconds_sum")
        messages = sum(
            _metric(ports[arm], name)
            for name in ("kvledger_messages_applied_total", "kvledger_messages_rejected_total",
                         "kvledger_messages_duplicate_total")
        )  # fmt: skip
        applied[arm] = messages / seconds if seconds else 0.0
        procs[arm].send_signal(signal.SIGTERM)
        procs[arm].wait(60)
    middle = len(samples["baseline"]) // 2
    figures: dict[str, float | str] = {
        "minutes": minutes,
        "messages/s published per index": rate,
    }
    for arm in ARMS:
        figures[f"{arm}: messages published"] = float(counts.get(arm, 0))
        figures[f"{arm}: schema MiB, middle sample"] = samples[arm][middle] / 2**20
        figures[f"{arm}: schema MiB, last sample"] = samples[arm][-1] / 2**20
        figures[f"{arm}: last / middle"] = samples[arm][-1] / max(samples[arm][middle], 1)
        figures[f"{arm}: apply msg/s of batch time"] = applied[arm]
    figures["apply rate, retention / baseline"] = applied["retention"] / max(
        applied["baseline"], 1e-9
    )
    figures["schema sizes MiB every 30 s, retention"] = ", ".join(
        f"{b / 2**20:.1f}" for b in samples["retention"]
    )
    figures["schema sizes MiB every 30 s, baseline"] = ", ".join(
        f"{b / 2**20:.1f}" for b in samples["baseline"]
    )
    for arm in ARMS:
        admin.delete_topics([topics[arm], f"{topics[arm]}.dlq"])
        drop_database(server, f"{base}_soak_{arm}")
    record("retention", figures)
    return figures


def _tables(url: str) -> dict[str, tuple[int, int, int]]:
    """{table: (bytes, live rows, dead rows)}."""
    with connect(url, autocommit=True) as conn:
        rows = conn.execute(_TABLES).fetchall()
    return {str(name): (int(size), int(live), int(dead)) for name, size, live, dead in rows}


SOAK_WINDOW = 50  # rounds averaged at round 100 and at the end


def _audit_rows(url: str) -> int:
    with connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM kvledger.events").fetchone()
    return int(row[0]) if row else 0


def tables_bytes(tables: dict[str, dict[str, tuple[int, int, int]]], when: str) -> int:
    return sum(size for size, _, _ in tables.get(when, {}).values())


def soak(rounds: int = 800, rate: float = 2000.0, requests: int = 40) -> dict[str, float | str]:
    """The retention arm alone for ``rounds`` rounds (see the module docstring)."""
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    server = os.environ["KVLEDGER_DATABASE_URL"]
    base = sa.engine.make_url(server).database
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    url = create_database(server, f"{base}_soak_long", replace=True)
    migrate(url)
    with connect(url, autocommit=True) as conn:
        set_partition_interval(conn, parse_duration("30s"))
    topic = f"soak-long-{uuid.uuid4().hex[:8]}"
    ensure_topic(admin, topic, 12)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", "consume", "--bootstrap", bootstrap,
         "--database-url", url, "--topic", topic, "--consumer-group", "soak-long",
         "--no-migrate", "--dlq-topic", f"{topic}.dlq", *ARMS["retention"]],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    done = [0]
    stop = threading.Event()

    def publish_rounds() -> None:
        while done[0] < rounds and not stop.is_set():
            fleet = FleetConfig(instances=4, requests=requests, seed=17)
            run_simulation(bootstrap, topic, fleet, partitions=12, show_progress=False,
                           rate=rate)  # fmt: skip
            done[0] += 1

    publisher = threading.Thread(target=publish_rounds)
    started = time.monotonic()
    publisher.start()
    samples: list[tuple[int, float, int]] = []  # (rounds done, seconds, schema bytes)
    tables: dict[str, dict[str, tuple[int, int, int]]] = {}
    retained: dict[str, int] = {}  # audit rows in the retained window: the write volume
    try:
        while publisher.is_alive():
            time.sleep(2.0)
            samples.append((done[0], time.monotonic() - started, _schema_bytes(url)))
            if "round 100" not in tables and done[0] >= 100:
                tables["round 100"] = _tables(url)
                retained["round 100"] = _audit_rows(url)
            if len(samples) % 15 == 0:
                print(f"  round {done[0]:4d}, {samples[-1][1]:5.0f} s: "
                      f"{samples[-1][2] / 2**20:7.1f} MiB", flush=True)  # fmt: skip
        tables["end"] = _tables(url)
        retained["end"] = _audit_rows(url)
    finally:
        stop.set()
        publisher.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        admin.delete_topics([topic, f"{topic}.dlq"])
        drop_database(server, f"{base}_soak_long")

    def mean_mib(lo: int, hi: int) -> float:
        sizes = [b for r, _, b in samples if lo <= r < hi] or [0]
        return sum(sizes) / len(sizes) / 2**20

    at_100 = mean_mib(100, 100 + SOAK_WINDOW)
    at_end = mean_mib(rounds - SOAK_WINDOW, rounds + 1)
    figures: dict[str, float | str] = {
        "rounds": float(rounds),
        "messages/s published": rate,
        "minutes": samples[-1][1] / 60 if samples else 0.0,
        f"schema MiB, mean over rounds 100-{100 + SOAK_WINDOW}": at_100,
        f"schema MiB, mean over the last {SOAK_WINDOW} rounds": at_end,
        "end / round 100 (target <= 1.10)": at_end / max(at_100, 1e-9),
        "audit rows retained, round 100 -> end": f"{retained.get('round 100', 0)} -> "
        f"{retained.get('end', 0)}",
        "schema bytes per audit row retained, end / round 100": (
            (tables_bytes(tables, "end") / max(retained.get("end", 0), 1))
            / max(tables_bytes(tables, "round 100") / max(retained.get("round 100", 0), 1), 1e-9)
        ),
        "schema MiB every 30 s": ", ".join(f"{b / 2**20:.0f}" for _, _, b in samples[14::15]),
    }
    for name in sorted(tables.get("end", {}), key=lambda t: -tables["end"][t][0]):
        size, live, dead = tables["end"][name]
        before = tables.get("round 100", {}).get(name, (0, 0, 0))
        figures[f"{name}: MiB at round 100 -> end"] = (
            f"{before[0] / 2**20:.1f} -> {size / 2**20:.1f} "
            f"(live rows {before[1]} -> {live}, dead {before[2]} -> {dead})"
        )
    record("retention-soak", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m bench.retention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "minutes",
        nargs="?",
        type=float,
        default=10.0,
        help="how long the side-by-side run lasts (default 10)",
    )
    parser.add_argument(
        "--soak",
        nargs="?",
        type=int,
        const=800,
        metavar="ROUNDS",
        help="the long run of the retention arm alone (800 rounds by default)",
    )
    args = parser.parse_args()
    if args.soak:
        written = publish(
            {"retention-soak": soak(args.soak)},
            PUBLISHED / "retention-soak",
            command=f"python -m bench.retention --soak {args.soak}",
        )
        print(f"wrote {', '.join(str(w) for w in written)}")
    else:
        main(args.minutes)
