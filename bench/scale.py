"""Consumers by partition: 1, 2 and 3 `kvledger consume` processes in one consumer group
build one index from the same topic, side by side in one run, and where the time goes.

The topic (6 partitions) holds a simulated fleet's messages, produced once: by default
enough that one consumer applies for well over 60 s. Its 12 instances are placed two to a
partition (each instance's streams on one), so every partition carries the same work and
a count of consumers that divides 6 gets even shares: with the publisher's partitioner,
this few keys land unevenly (one partition held ten times another's messages), and the
figures measured the skew rather than the consumers. For each count of consumers: a fresh
database, that many `kvledger consume --until-caught-up` processes started together. The
figures are taken over a window that leaves their start-up out: from the moment the
group's first batch is committed (imports, the group join and the first poll are behind
every consumer by then) to the last consumer's exit. In that window: block events applied
per second and the ratio to one consumer; CPU per process, as cores used (each consumer,
from /proc and its rusage; PostgreSQL, every server process; the broker), and the machine's
share busy. Whichever saturates is the ceiling: the figures say which.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
import zlib
from datetime import datetime

from confluent_kafka.admin import AdminClient, NewTopic

from bench.common import PUBLISHED, publish, raw_produce, record, settle
from bench.consume import _database, _messages
from kvledger.consumer.db import connect
from kvledger.fleet import FleetConfig

PARTITIONS = 6
CLOCK = os.sysconf("SC_CLK_TCK")
INSTANCES = 12
REQUESTS = 7500  # ~1.9 M messages, ~5.8 M block events: over 60 s for one consumer here


def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu_of(pattern: str) -> float:
    """CPU seconds (user + system) of every process whose command line (or, for one that
    has exited and not yet been reaped, whose name) contains ``pattern``, with the children
    each has reaped: PostgreSQL's backends exit with their connections, and their time then
    counts in the postmaster's. An exited backend is read until the postmaster reaps it
    (its command line is gone by then, its name is not), so no backend's time is lost
    between the two."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/comm", "rb") as f:
                name = f.read()
        except OSError:
            continue
        if pattern.encode() not in (cmdline or name):
            continue
        fields = _stat(pid)
        if fields is not None:
            total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLOCK  # utime .. cstime
    return total


def _own_cpu(pid: int) -> float:
    """CPU seconds (user + system) one live process has used so far."""
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK


def _partition(key: bytes) -> int:
    """An instance's streams (keys ``engine-<i>/<group>``) all on partition i mod 6 (any
    other key where the publisher's partitioner would put it)."""
    number = key.split(b"/")[0].rsplit(b"-", 1)[-1]
    return int(number) % PARTITIONS if number.isdigit() else zlib.crc32(key) % PARTITIONS


def _first_commit(url: str, group: str, procs: list[subprocess.Popen[bytes]]) -> datetime:
    """Wait for the group's first committed batch; the database's clock then."""
    with connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT now(), coalesce(sum(next_offset), 0) FROM kvledger.consumer_offsets "
                "WHERE consumer_group = %s",
                (group,),
            ).fetchone()
            assert row is not None
            if row[1] > 0:
                return row[0]
            if all(p.poll() is not None for p in procs):
                raise RuntimeError("every consumer exited before its first batch")
            time.sleep(0.05)


def run(server: str, bootstrap: str, topic: str, consumers: int) -> dict[str, float]:
    url = _database(server, f"kvledger_bench_scale_{consumers}")
    group = f"bench-scale-{consumers}-{uuid.uuid4().hex[:6]}"
    settle(server)
    command = [
        sys.executable, "-m", "kvledger", "consume", "--bootstrap", bootstrap,
        "--database-url", url, "--topic", topic, "--consumer-group", group,
        "--dlq-topic", f"{topic}.dlq", "--until-caught-up", "--no-migrate",
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*command, "--group-instance-id", f"c{i}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(consumers)
    ]
    began_db = _first_commit(url, group, procs)
    began = time.perf_counter()
    own_before = [_own_cpu(p.pid) for p in procs]
    pg_before, broker_before = _cpu_of("postgres"), _cpu_of("kafka.Kafka")
    own = []
    for proc, before in zip(procs, own_before, strict=True):
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"a consumer exited {proc.returncode}")
        own.append(usage.ru_utime + usage.ru_stime - before)
    seconds = time.perf_counter() - began
    pg_cpu = _cpu_of("postgres") - pg_before
    broker_cpu = _cpu_of("kafka.Kafka") - broker_before
    with connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(hash_count) FILTER (WHERE applied_at >= %s), 0), "
            "coalesce(sum(hash_count), 0) FROM kvledger.events WHERE status = 'applied'",
            (began_db,),
        ).fetchone()
    assert row is not None
    events, total = float(row[0]), float(row[1])
    cores = os.cpu_count() or 1
    figures = {
        "window s (start-up excluded)": seconds,
        "block events/s": events / seconds,
        "block events in the window": events,
        "block events in all": total,
    }
    for i, cpu in enumerate(own):
        figures[f"consumer {i + 1} cores"] = cpu / seconds
    figures |= {
        "consumers cores": sum(own) / seconds,
        "PostgreSQL cores": pg_cpu / seconds,
        "broker cores": broker_cpu / seconds,
        "machine busy (cores used / cores)": (sum(own) + pg_cpu + broker_cpu) / (seconds * cores),
    }
    return figures


def main(requests: int = REQUESTS) -> dict[str, float]:
    server = os.environ["KVLEDGER_DATABASE_URL"]
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    messages = _messages(FleetConfig(instances=INSTANCES, requests=requests, seed=23))
    topic = f"bench-scale-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    raw_produce(bootstrap, topic, messages, partition_of=_partition)
    figures: dict[str, float] = {
        "messages": float(len(messages)),
        "cores": float(os.cpu_count() or 1),
    }
    del messages
    one = 0.0
    try:
        for consumers in (1, 2, 3):
            result = run(server, bootstrap, topic, consumers)
            rate = result["block events/s"]
            one = one or rate
            for key, value in result.items():
                figures[f"{consumers} consumer(s): {key}"] = value
            figures[f"{consumers} consumer(s): ratio to one"] = rate / one
    finally:
        admin.delete_topics([topic, f"{topic}.dlq"])
    record("consume_scale", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument(
        "--requests", type=int, default=REQUESTS,
        help=f"simulated requests across {INSTANCES} instances (default: %(default)s)",
    )  # fmt: skip
    figures = main(parser.parse_args().requests)
    written = publish({"consume_scale": figures}, PUBLISHED / "scale",
                      command="python -m bench.scale")  # fmt: skip
    print(f"wrote {', '.join(str(w) for w in written)}")
