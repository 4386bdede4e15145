"""Consumers by partition: 1, 2 and 3 `kvledger consume` processes in one consumer group
build one index from the same topic, side by side in one run, and where the time goes.

The topic (6 partitions) holds a simulated fleet's messages, produced once. For each count
of consumers: a fresh database, that many `kvledger consume --until-caught-up` processes
started together, wall time until the last one exits. Figures: block events/s and the ratio
to one consumer; CPU seconds spent by the consumers (their rusage), by PostgreSQL (every
server process, from /proc) and by the broker (from /proc), against the machine's cores:
whichever saturates is the ceiling.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from confluent_kafka.admin import AdminClient, NewTopic

from bench.common import raw_produce, record, settle
from bench.consume import _database, _messages
from kvledger.consumer.db import connect
from kvledger.fleet import FleetConfig

PARTITIONS = 6
CLOCK = os.sysconf("SC_CLK_TCK")


def _cpu_of(pattern: str) -> float:
    """CPU seconds (user + system) of every process whose command line contains ``pattern``,
    with the children each has reaped: PostgreSQL's backends exit with their connections,
    and their time then counts in the postmaster's."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if pattern.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLOCK  # utime .. cstime
        except OSError:
            continue
    return total


def run(server: str, bootstrap: str, topic: str, consumers: int) -> dict[str, float]:
    url = _database(server, f"kvledger_bench_scale_{consumers}")
    group = f"bench-scale-{consumers}-{uuid.uuid4().hex[:6]}"
    settle(server)
    pg_before, broker_before = _cpu_of("postgres"), _cpu_of("kafka.Kafka")
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvledger",
                "consume",
                "--bootstrap",
                bootstrap,
                "--database-url",
                url,
                "--topic",
                topic,
                "--consumer-group",
                group,
                "--dlq-topic",
                f"{topic}.dlq",
                "--until-caught-up",
                "--no-migrate",
                "--group-instance-id",
                f"c{i}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(consumers)
    ]
    consumer_cpu = 0.0
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"a consumer exited {proc.returncode}")
        consumer_cpu += usage.ru_utime + usage.ru_stime
    seconds = time.perf_counter() - start
    pg_cpu = _cpu_of("postgres") - pg_before
    broker_cpu = _cpu_of("kafka.Kafka") - broker_before
    with connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(hash_count), 0) FROM kvledger.events WHERE status = 'applied'"
        ).fetchone()
    events = float(row[0]) if row else 0.0
    cores = os.cpu_count() or 1
    return {
        "seconds": seconds,
        "block events/s": events / seconds,
        "consumers CPU s": consumer_cpu,
        "PostgreSQL CPU s": pg_cpu,
        "broker CPU s": broker_cpu,
        "machine busy (CPU s / (wall s x cores))": (consumer_cpu + pg_cpu + broker_cpu)
        / (seconds * cores),
        "block events": events,
    }


def main() -> None:
    server = os.environ["KVLEDGER_DATABASE_URL"]
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    fleet = FleetConfig(instances=6, requests=900, seed=23)
    messages = _messages(fleet)
    topic = f"bench-scale-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    raw_produce(bootstrap, topic, messages)
    figures: dict[str, float] = {"messages": float(len(messages))}
    one = 0.0
    for consumers in (1, 2, 3):
        result = run(server, bootstrap, topic, consumers)
        rate = result["block events/s"]
        one = one or rate
        for key, value in result.items():
            figures[f"{consumers} consumer(s): {key}"] = value
        figures[f"{consumers} consumer(s): ratio to one"] = rate / one
    admin.delete_topics([topic, f"{topic}.dlq"])
    record("consume_scale", figures)


if __name__ == "__main__":
    main()
