"""Consumers as the tests run them: in-process until caught up, as a child process, and
the log read back by partition."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import sqlalchemy as sa

from kvledger.consumer.applier import stored_offsets
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect
from kvledger.consumer.service import IndexConsumer
from kvledger.consumer.summary import RunSummary
from tests.helpers.kafka import consume_all
from tests.helpers.procs import spawn

ROOT = Path(__file__).resolve().parents[2]


def consume(bootstrap: str, db: str, topic: str, group: str, batch: int = 2000) -> RunSummary:
    config = ConsumerConfig(
        bootstrap_servers=bootstrap,
        database_url=db,
        topic=topic,
        group_id=group,
        dlq_topic=f"{topic}.dlq",
        batch_size=batch,
        batch_timeout_s=0.2,
        until_caught_up=True,
    )
    return IndexConsumer(config).run()


def by_partition(bootstrap: str, topic: str, group: str, count: int) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = defaultdict(list)
    for msg in sorted(
        consume_all(bootstrap, topic, group, count), key=lambda m: (m.partition(), m.offset())
    ):
        out[msg.partition()].append(msg.value())
    return out


def consumer_process(
    bootstrap: str,
    db: str,
    topic: str,
    group: str,
    until_caught_up: bool,
    instance_id: str | None = None,
) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "kvledger.cli",
        "consume",
        "--bootstrap",
        bootstrap,
        "--database-url",
        db,
        "--topic",
        topic,
        "--consumer-group",
        group,
        "--dlq-topic",
        f"{topic}.dlq",
        "--batch-size",
        "300",
        "--batch-timeout",
        "0.2",
        "--no-migrate",
    ]
    if until_caught_up:
        args.append("--until-caught-up")
    if instance_id:
        args += ["--group-instance-id", instance_id]
    log = os.environ.get("KVLEDGER_TEST_CONSUMER_LOG")
    sink = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return spawn(args, cwd=ROOT, stdout=sink, stderr=sink)


def wait_caught_up(bootstrap: str, db: str, topic: str, group: str, timeout: float = 120) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = list(admin.list_topics(topic, timeout=10).topics[topic].partitions)
    request = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
    ends = {tp.partition: f.result().offset for tp, f in admin.list_offsets(request).items()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connect(db, autocommit=True) as conn:
            stored = stored_offsets(conn, group, topic)
        if all(stored.get(p, 0) >= end for p, end in ends.items()):
            return
        time.sleep(0.3)
    raise AssertionError(f"not caught up within {timeout} s: {stored} vs {ends}")


def with_session_setting(url: str, name: str, value: str) -> str:
    """The database URL with a setting every session it opens starts with."""
    parsed = sa.engine.make_url(url)
    # No spaces: a URL's query encodes them as '+', which libpq would keep.
    assert "options" not in parsed.query
    options = f"-c{name}={value}"
    return parsed.update_query_dict({"options": options}).render_as_string(hide_password=False)


def residencies_of(db: str, source: str) -> dict[tuple[int, bytes, str, str], int]:
    """A source's residencies in the index: (group, hash, medium, ownership) -> refcount."""
    from kvledger.consumer.db import connect

    with connect(db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT group_idx, block_hash, medium, ownership, refcount "
            "FROM kvledger.residencies WHERE instance = %s",
            (source,),
        ).fetchall()
    return {(g, bytes(h), m, o): n for g, h, m, o, n in rows}


def lost_ranges(db: str, source: str) -> list[tuple[int, int]]:
    """The engine-batch ranges the index recorded lost for a source."""
    from kvledger.consumer.db import connect

    with connect(db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT DISTINCT first_lost_seq, last_lost_seq FROM kvledger.lifecycle_events "
            "WHERE kind = 'lost' AND source = %s ORDER BY 1",
            (source,),
        ).fetchall()
    return [(a, b) for a, b in rows]
