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
"""

from __future__ import annotations

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

from bench.common import record
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


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 10.0)
