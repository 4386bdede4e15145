"""Fencing on the stored offsets, on a real PostgreSQL server: a batch that does not start at
a partition's stored offset is abandoned whole, including the very first batch of a
partition that two consumers hold at once. And two consumers of different partitions that
store the same new block at once: the later writer merges it; or the same residency, when
one engine publishes on two topics: the later write fails whole and is planned again."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import psycopg
import pytest

from kvledger.consumer import metrics
from kvledger.consumer.core.model import Plan
from kvledger.consumer.core.needs import needs
from kvledger.consumer.core.plan import make_plan
from kvledger.consumer.db import connect
from kvledger.consumer.inbound import Decoded, Inbound
from kvledger.consumer.pipeline import decode_batch, fence_points, run_batch, write_batch
from kvledger.consumer.store.base import FencedError
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import BlockStored, Envelope, GroupSpec

pytestmark = pytest.mark.integration
TOPIC = "fence"


def _batch(first_offset: int, count: int) -> list[Inbound]:
    codec = Codec()
    out = []
    for i in range(first_offset, first_offset + count):
        if i == 0:
            event: GroupSpec | BlockStored = GroupSpec("m", 0, "full_attention", 4, 4)
        else:
            event = BlockStored(
                (i.to_bytes(8, "big"),), None, (i, i, i, i), 4, None, "GPU", None, group_idx=0
            )
        value = codec.encode(Envelope("engine-0", "m", 0, 1, i, 1_764_000_000_000 + i, event))
        out.append(Inbound(TOPIC, 0, i, b"engine-0/0", value))
    return out


def _messages(
    codec: Codec,
    events: Sequence[GroupSpec | BlockStored],
    source: str = "engine-0",
    topic: str = TOPIC,
    partition: int = 0,
    at_ms: int = 1_764_000_000_000,
) -> list[Inbound]:
    """One source's events as consumed messages from offset 0, one ms apart."""
    return [Inbound(topic, partition, i, f"{source}/0".encode(),
                    codec.encode(Envelope(source, "m", 0, 1, i, at_ms + i, e)))
            for i, e in enumerate(events)]  # fmt: skip


def _plan(store: PostgresStore, batch: list[Decoded]) -> Plan:
    """A batch planned over what ``store`` holds now (written later, by the test)."""
    with store.transaction():
        snapshot = store.load(needs(batch, keys=True))
    return make_plan(batch, snapshot)


def _conflicts() -> float:
    """The process's count of new block rows that met another consumer's."""
    value = metrics.REGISTRY.get_sample_value("kvledger_new_block_conflicts_total")
    assert value is not None
    return value


def _counts(url: str) -> tuple[int, int, int]:
    with connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM kvledger.events), "
            "(SELECT count(*) FROM kvledger.residencies), "
            "(SELECT next_offset FROM kvledger.consumer_offsets WHERE kafka_topic = %s)",
            (TOPIC,),
        ).fetchone()
    assert row is not None
    return row


def test_a_batch_behind_or_ahead_of_the_stored_offset_is_fenced(fresh_database: str) -> None:
    codec = Codec()
    with connect(fresh_database, autocommit=True) as conn:
        store = PostgresStore(conn)
        run_batch(_batch(0, 10), codec, store, "g")
        for start in (0, 5, 11):  # re-read, overlapping, skipping ahead
            with pytest.raises(FencedError, match=f"stored 10, batch starts {start}"):
                run_batch(_batch(start, 3), codec, store, "g")
        run_batch(_batch(10, 5), codec, store, "g")
    assert _counts(fresh_database) == (15, 14, 15)


def test_two_consumers_with_the_same_first_batch_apply_it_once(fresh_database: str) -> None:
    codec = Codec()
    outcome: list[BaseException | None] = []
    with connect(fresh_database, autocommit=True) as a, connect(fresh_database) as b:
        first, second = PostgresStore(a), PostgresStore(b)
        # The first consumer's batch transaction stays open (the outer transaction) while
        # the second one tries the same first batch.
        with a.transaction():
            run_batch(_batch(0, 10), codec, first, "g")

            def other() -> None:  # blocks on the first consumer's offsets row
                try:
                    run_batch(_batch(0, 10), codec, second, "g")
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=other)
            thread.start()
            thread.join(1.0)
            assert thread.is_alive(), "the second consumer must wait for the first"
        thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], FencedError), outcome
    assert _counts(fresh_database) == (10, 9, 10)


def test_a_new_block_another_consumer_stored_since_the_plan_is_merged(
    fresh_database: str,
) -> None:
    """The store copies a block it had no row for straight into the table; here another
    consumer stores the same block between this one's plan and its write, so the copy
    meets that row and the write merges it instead (first seen: the earlier event)."""
    codec = Codec()
    events = (
        GroupSpec("m", 0, "full_attention", 4, 4),
        BlockStored((b"\x01" * 8,), None, (1, 2, 3, 4), 4, None, "GPU", None, group_idx=0),
    )

    with (
        connect(fresh_database, autocommit=True) as a,
        connect(fresh_database, autocommit=True) as b,
    ):
        mine, later = PostgresStore(a), PostgresStore(b)
        batch = decode_batch(_messages(codec, events), codec)
        plan = _plan(mine, batch)
        assert [w.stored for w in plan.blocks.values()] == [False]
        before = _conflicts()
        run_batch(_messages(codec, events, "engine-1", partition=1, at_ms=1_764_000_005_000),
                  codec, later, "g")  # fmt: skip
        assert _conflicts() == before  # the first writer copied it: no conflict
        write_batch(mine, plan, "g", *fence_points(batch, None))
        assert _conflicts() == before + 1
        rows = a.execute(
            "SELECT extract(epoch FROM first_seen) * 1000, extract(epoch FROM last_seen) * 1000, "
            "token_ids FROM kvledger.blocks"
        ).fetchall()
        holders = a.execute("SELECT instance FROM kvledger.residencies ORDER BY 1").fetchall()
    assert rows == [(1_764_000_000_001, 1_764_000_005_001, [1, 2, 3, 4])]
    assert holders == [("engine-0",), ("engine-1",)]


def test_a_residency_another_writer_opened_since_the_plan_fails_the_write_whole(
    fresh_database: str,
) -> None:
    """A residency new to the store is copied straight in, with its open interval. One
    engine's messages reach the index through one partition, unless it publishes on two
    topics: here its store of a block comes in from the other topic between this batch's
    plan and its write. The write then fails whole (on the open interval), leaving nothing
    of the batch, and the batch planned again finds those messages applied already."""
    codec = Codec()
    events = (
        GroupSpec("m", 0, "full_attention", 4, 4),
        BlockStored((b"\x02" * 8,), None, (1, 2, 3, 4), 4, None, "GPU", None, group_idx=0),
    )

    with (
        connect(fresh_database, autocommit=True) as a,
        connect(fresh_database, autocommit=True) as b,
    ):
        mine, other = PostgresStore(a), PostgresStore(b)
        batch = decode_batch(_messages(codec, events), codec)
        plan = _plan(mine, batch)
        run_batch(_messages(codec, events, topic="fence-other"), codec, other, "g")
        with pytest.raises(psycopg.errors.UniqueViolation, match="residency_history_open"):
            write_batch(mine, plan, "g", *fence_points(batch, None))
        again = run_batch(_messages(codec, events), codec, mine, "g")
        rows = a.execute(
            "SELECT instance, refcount, kafka_topic FROM kvledger.residencies"
        ).fetchall()
        audit = a.execute(
            "SELECT status, count(*) FROM kvledger.events WHERE kafka_topic = %s GROUP BY 1",
            (TOPIC,),
        ).fetchall()
    assert again.next_offsets == {(TOPIC, 0): 2}
    assert rows == [("engine-0", 1, "fence-other")]
    assert audit == [("duplicate", 2)]


def test_a_placeholder_another_consumer_stored_since_the_plan_keeps_its_content(
    fresh_database: str,
) -> None:
    """A placeholder (a legacy tail hash, no tokens; only groups other than full attention
    take one) named again by another placeholder keeps the content it was first stored
    with (the core's upgrades(): nothing replaces a row with a placeholder). Here the other
    consumer's placeholder is committed between this one's plan and its write: the row ends
    as it does when the two apply one after the other in that order, not with the later
    writer's parent."""
    codec = Codec()
    tail = b"\x07" * 8

    def events(parent: bytes) -> tuple[GroupSpec, BlockStored]:
        return (
            GroupSpec("m", 0, "sliding_window", 4, 4, 64),
            BlockStored((tail,), parent, (), 0, None, "GPU", None, group_idx=0),
        )

    def parents(url: str) -> list[tuple[bytes, int]]:
        with connect(url, autocommit=True) as conn:
            rows = conn.execute("SELECT parent_hash, block_size FROM kvledger.blocks").fetchall()
        return [(bytes(p), size) for p, size in rows]

    with (
        connect(fresh_database, autocommit=True) as a,
        connect(fresh_database, autocommit=True) as b,
    ):
        mine, other = PostgresStore(a), PostgresStore(b)
        batch = decode_batch(_messages(codec, events(b"\x0a" * 8)), codec)
        plan = _plan(mine, batch)
        run_batch(_messages(codec, events(b"\x0b" * 8), "engine-1", partition=1), codec, other, "g")
        write_batch(mine, plan, "g", *fence_points(batch, None))
    assert parents(fresh_database) == [(b"\x0b" * 8, 0)]
