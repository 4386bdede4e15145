"""One suite, every store: the same event streams through the PostgreSQL store (a real
server) and the memory store must leave identical indexes, table by table.

The streams: every rule's edge cases on three partitions, and a simulated fleet (partial
tails, STORAGE demotions, placeholders, a misconfigured source). Each store gets other
batch boundaries, so the comparison also shows the index does not depend on them.
"""

from __future__ import annotations

import dataclasses
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
from kvledger.schemas.codec import SINGLE_OBJECT_MAGIC
from kvledger.schemas.events import Goodbye, GroupSpec, Heartbeat
from tests.helpers.streams import Stream, cleared, fleet_stream, h, removed, spec, stored

pytestmark = pytest.mark.integration

LATE_GROUP = spec(7)  # declared only after the stream: its events are rejected, then replayed


def edge_stream() -> Stream:
    s = Stream(partitions=3)
    a, b, c = "engine-a", "engine-b", "engine-c"
    for source in (a, b, c):
        s.send(source, spec(0, block=8, hash_size=4))
        s.send(source, spec(1, kind="sliding_window"))
    s.send(a, GroupSpec("m", 0, "full_attention", 16, 4))  # spec_conflict
    for i in range(6):
        s.send(a, stored([i, i + 1], size=8, start=16 * i))
        s.send(b, stored([i], size=8, start=16 * i, medium="GPU"))
        s.send(b, stored([i + 100], size=4, start=8, partial=True))
        s.send(c, stored([i], size=8, start=16 * i, medium="STORAGE", ownership="disk"))
    placeholder = stored([50], group=1)
    s.send(a, type(placeholder)((h(50),), None, (), 0, None, "CPU", None, group_idx=1))
    s.send(b, stored([50], group=1, start=4))  # upgrades the placeholder row
    s.send(a, stored([1], size=8, start=16, salt=3))  # hash_conflict
    s.send(a, stored([9], size=16))  # block_size_mismatch
    s.send(a, stored([9], group=7, size=4))  # unknown_group (until declared)
    s.send(b, removed([9], group=7))  # unknown_group (until declared)
    s.send(a, removed([0, 1, 1, 1]))  # the third and fourth are no-ops
    s.send(a, stored([3], size=8, start=48), seq=3)  # a duplicate
    s.send(a, stored([4], size=8, start=64), seq=40)  # a gap
    s.send(b, cleared(medium="GPU"))  # every group
    s.send(c, stored([20], size=8, start=0, medium="STORAGE", ownership="disk"), epoch=2, seq=0)
    s.send(c, stored([21], size=8, start=8), epoch=1, seq=99)  # stale_epoch
    s.send(b, cleared(medium="CPU", group=0))
    s.raw(b"\x00\x01 not avro")  # undecodable
    s.raw(SINGLE_OBJECT_MAGIC + bytes(8) + b"\x02")  # unknown_schema
    s.send(a, stored([5, 6], size=8, start=80))
    s.send(a, removed([5], medium="CPU"))
    s.send(a, Heartbeat(group_idx=0, interval_ms=5000))
    s.send(b, stored([30], size=8, start=0, medium="GPU"))
    s.send(b, stored([31], size=8, start=0, medium="STORAGE", ownership="disk"))
    s.send(b, Goodbye(group_idx=0))  # GPU and CPU end "closed" in every group
    s.send(b, stored([32], size=8, start=8, medium="GPU"))  # back after its goodbye
    keep_cpu = dataclasses.replace(spec(0, block=8, hash_size=4), surviving_media=("CPU",))
    s.send(a, keep_cpu, epoch=3, seq=0)  # a restart that keeps CPU (and ends STORAGE)
    return s


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
    assert len(postgres["residencies"]) >= 8 and len(postgres["residency_history"]) >= 8
    assert len(postgres["rejected_events"]) >= (8 if name == "edge cases" else 1)
    if name == "edge cases":
        kinds = {(row[0], row[3]) for row in postgres["lifecycle_events"]}
        assert kinds == {("engine-c", "restart"), ("engine-b", "closed"), ("engine-a", "restart")}
        assert len(postgres["sources"]) == 3
    statuses = {row[13] for row in postgres["events"]}
    assert statuses == ({"applied", "rejected", "duplicate"} if name == "edge cases" else statuses)
