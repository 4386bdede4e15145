"""Fencing on the stored offsets, on a real PostgreSQL server: a batch that does not start at
a partition's stored offset is abandoned whole, including the very first batch of a
partition that two consumers hold at once."""

from __future__ import annotations

import threading

import pytest

from consumer.apply import BatchApplier, FencedError
from consumer.db import connect
from consumer.inbound import Decoded, Inbound, decode
from schemas.codec import Codec
from schemas.events import BlockStored, Envelope, GroupSpec

pytestmark = pytest.mark.integration
TOPIC = "fence"


def _batch(first_offset: int, count: int) -> list[Decoded]:
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
        out.append(decode(Inbound(TOPIC, 0, i, b"engine-0/0", value), codec))
    return out


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
    applier = BatchApplier("g")
    with connect(fresh_database, autocommit=True) as conn:
        with conn.transaction():
            applier.apply(conn, _batch(0, 10))
        for start in (0, 5, 11):  # re-read, overlapping, skipping ahead
            with (
                pytest.raises(FencedError, match=f"stored 10, batch starts {start}"),
                conn.transaction(),
            ):
                applier.apply(conn, _batch(start, 3))
        with conn.transaction():
            applier.apply(conn, _batch(10, 5))
    assert _counts(fresh_database) == (15, 14, 15)


def test_two_consumers_with_the_same_first_batch_apply_it_once(fresh_database: str) -> None:
    first, second = BatchApplier("g"), BatchApplier("g")
    outcome: list[BaseException | None] = []
    with connect(fresh_database, autocommit=True) as a, connect(fresh_database) as b:
        with a.transaction():
            first.apply(a, _batch(0, 10))

            def other() -> None:  # blocks on the first consumer's offsets row
                try:
                    with b.transaction():
                        second.apply(b, _batch(0, 10))
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
