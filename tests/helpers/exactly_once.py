"""A steady simulated fleet and a consumer under faults, and the checks that end every such
test: each message audited exactly once, no source with a gap or a duplicate, and the index
equal to a rebuild from the log (`kvledger verify`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from kvledger.consumer.applier import stored_offsets
from kvledger.consumer.db import connect
from kvledger.consumer.verify import verify
from tests.helpers.consuming import ROOT
from tests.helpers.procs import spawn


def producer_process(
    bootstrap: str, topic: str, requests: int, rate: int, seed: int = 4
) -> subprocess.Popen[str]:
    """`kvledger simulate` at ``rate`` messages a second (the producer library's path, a
    misconfigured source among the engines), its summary on stdout."""
    return spawn(
        [sys.executable, "-m", "kvledger.cli", "simulate", "--bootstrap", bootstrap,
         "--topic", topic, "--partitions", "6", "--instances", "3", "--requests", str(requests),
         "--rate", str(rate), "--seed", str(seed), "--misconfigured-source"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip


def produced(proc: subprocess.Popen[str], timeout: float = 300) -> int:
    """The messages a finished :func:`producer_process` had acknowledged (all it produced)."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("messages:"))
    count, acked = int(line.split()[1]), int(line.split()[3])
    assert count == acked
    return count


def assert_verified(bootstrap: str, db: str, topic: str, group: str) -> None:
    result = verify(bootstrap, db, topic, group)
    assert result.ok, [(d.table, d.only_live[:2], d.only_rebuilt[:2]) for d in result.differences]


def assert_all_audited_and_verified(
    bootstrap: str, db: str, topic: str, group: str, count: int
) -> None:
    """One audit row per produced message, and the index equals a rebuild from the topic."""
    with connect(db, autocommit=True) as conn:
        (events,) = conn.execute("SELECT count(*) FROM kvledger.events").fetchone()
    assert events == count
    assert_verified(bootstrap, db, topic, group)


def wait_indexed(bootstrap: str, db: str, topic: str, group: str, timeout: float = 300) -> None:
    """Wait until the index has stored every record now on ``topic``: each partition's
    stored offset at its end, or past the last record a read_committed reader finds there
    (a transactional producer's partition ends with a commit marker, or with an aborted
    transaction's records: the consumer reads past them, but stores no offset for them)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
    request = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
    ends = {tp.partition: f.result().offset for tp, f in admin.list_offsets(request).items()}
    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{group}-reader",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            with connect(db, autocommit=True) as conn:
                stored = stored_offsets(conn, group, topic)
            behind = {p: stored.get(p, 0) for p, end in ends.items() if stored.get(p, 0) < end}
            if not any(_a_record(reader, topic, p, at, ends[p]) for p, at in behind.items()):
                return
            assert time.monotonic() < deadline, f"not caught up in {timeout} s: {stored} vs {ends}"
            time.sleep(0.3)
    finally:
        reader.close()


def _a_record(reader: Consumer, topic: str, partition: int, start: int, end: int) -> bool:
    """A read_committed reader finds a record in [start, end) of the partition."""
    reader.assign([TopicPartition(topic, partition, start)])
    while (msg := reader.poll(30)) is not None:
        err = msg.error()
        if err is None:
            return (msg.offset() or 0) < end
        if err.code() == KafkaError._PARTITION_EOF:
            return False
        raise KafkaException(err)
    raise AssertionError(f"reading {topic}[{partition}] from {start} stalled")


def assert_exactly_once(
    bootstrap: str,
    db: str,
    topic: str,
    group: str,
    producer: subprocess.Popen[str],
    consumer: subprocess.Popen[bytes],
    timeout: float = 300,
    also_published: int = 0,
) -> float:
    """Let the fleet finish and the consumer catch up and stop, then every check above and
    no sequence gap or duplicate; the seconds the consumer took to catch up after the fleet.
    ``also_published``: the messages others (a relay) put on the topic, audited too."""
    count = produced(producer, timeout) + also_published
    started = time.monotonic()
    wait_indexed(bootstrap, db, topic, group, timeout=timeout)
    caught_up = time.monotonic() - started
    consumer.send_signal(signal.SIGTERM)
    assert consumer.wait(timeout=60) == 0
    with connect(db, autocommit=True) as conn:
        health = conn.execute(
            "SELECT sum(gap_count), sum(duplicates) FROM kvledger.source_health"
        ).fetchone()
    assert health == (0, 0)  # no sequence gaps, nothing written twice
    assert_all_audited_and_verified(bootstrap, db, topic, group, count)
    return caught_up
