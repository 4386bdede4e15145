"""One suite, every store: the same event streams through the PostgreSQL store (a real
server) and the memory store must leave identical indexes, table by table.

The streams: every rule's edge cases on three partitions, and a simulated fleet (partial
tails, STORAGE demotions, placeholders, a misconfigured source). Each store gets other
batch boundaries, so the comparison also shows the index does not depend on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvledger.consumer.admin import declare_group
from kvledger.consumer.admin import replay as replay_postgres
from kvledger.consumer.db import connect
from kvledger.consumer.inbound import Inbound, decode
from kvledger.consumer.pipeline import replay_batch, run_batch
from kvledger.consumer.store.base import IndexStore
from kvledger.consumer.store.memory import MemoryStore
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.consumer.verify import diff
from kvledger.consumer.verify import dump as dump_postgres
from kvledger.fleet import FleetConfig
from tests.helpers.streams import Stream, edge_stream, fleet_stream, spec

pytestmark = pytest.mark.integration

LATE_GROUP = spec(7)  # declared only after the stream: its events are rejected, then replayed


def consume(messages: Sequence[Inbound], store: IndexStore, codec: object, batch: int) -> None:
    for i in range(0, len(messages), batch):
        run_batch(messages[i : i + batch], codec, store, "g")  # type: ignore[arg-type]


def replay_memory(store: MemoryStore, stream: Stream) -> None:
    """What ``kvledger dlq replay`` does: pending rejections in log order, stale epochs
    left out (a newer epoch has re-announced its state)."""
    pending = sorted(
        (
            r.message
            for r, replayed in store.rejected.values()
            if not replayed and r.reason != "stale_epoch"
        ),
        key=lambda m: (m.topic, m.partition, m.offset),
    )
    replay_batch([decode(m, stream.codec) for m in pending if m.value], store)


@pytest.mark.parametrize("name", ["edge cases", "simulated fleet"])
def test_postgres_and_memory_stores_build_the_same_index(fresh_database: str, name: str) -> None:
    if name == "edge cases":
        stream = edge_stream()
    else:
        config = FleetConfig(instances=3, requests=50, seed=11, misconfigured_source=True)
        stream = fleet_stream(config, partitions=3)
    memory = MemoryStore()
    consume(stream.messages, memory, stream.codec, batch=7)
    with connect(fresh_database, autocommit=True) as conn:
        consume(stream.messages, PostgresStore(conn), stream.codec, batch=500)
        differences = diff(dump_postgres(conn), memory.dump())
        assert not differences, [
            (d.table, d.only_live[:2], d.only_rebuilt[:2]) for d in differences
        ]
        # Declaring the missing group and replaying the dead letters agrees as well.
        declare_group(conn, LATE_GROUP)
        memory.declare(LATE_GROUP)
        replay_postgres(conn)
        replay_memory(memory, stream)
        postgres = dump_postgres(conn)
    assert not diff(postgres, memory.dump())
    assert len(postgres["residencies"]) >= 6 and len(postgres["residency_history"]) >= 8
    assert len(postgres["rejected_events"]) >= (8 if name == "edge cases" else 1)
    if name == "edge cases":
        kinds = {(row[0], row[3]) for row in postgres["lifecycle_events"]}
        assert kinds == {
            ("engine-c", "restart"), ("engine-b", "closed"), ("engine-a", "restart"),
            ("engine-c", "lost"),
        }  # fmt: skip
        assert len(postgres["sources"]) == 4
        assert ("reported_reuse", 2) in {(row[14], row[12]) for row in postgres["events"]}
    statuses = {row[13] for row in postgres["events"]}
    assert statuses == ({"applied", "rejected", "duplicate"} if name == "edge cases" else statuses)
