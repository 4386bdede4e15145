"""Fencing on the stored offsets, on a real PostgreSQL server: a batch that does not start at
a partition's stored offset is abandoned whole, including the very first batch of a
partition that two consumers hold at once."""

from __future__ import annotations

import threading

import pytest

from kvledger.consumer.db import connect
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.pipeline import run_batch
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
