"""A router's start: one consistent snapshot of the PostgreSQL index read into a
:class:`~.store.RouterStore` — group specs, live residencies, the block rows, source states
and lives, and a consumer group's stored offsets — in one REPEATABLE READ transaction, so
that tailing the topic from those offsets neither misses nor repeats an event."""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from kvledger.consumer.core.model import GroupKey, ResidencyKey
from kvledger.consumer.store.pg_state import load_source_lives, load_source_states, load_specs
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.serving.router.store import RouterStore, walkable


def load_snapshot(
    conn: psycopg.Connection, consumer_group: str, topic: str, dynamo: bool, clock: int
) -> RouterStore:
    """The index as of one transaction. A block row counts as seen when the index last
    saw it stored (its ``last_seen``, at most ``clock``), so the router's expiry forgets an
    unheld block when the index's own retention would delete its row, not one whole
    retention after the router started; what else it loads counts as seen at ``clock``."""
    store = RouterStore(dynamo)
    store.set_clock(clock)
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        store.specs.update(load_specs(cur))
        stored = PostgresStore(conn).stored_offsets(consumer_group, topic)
        for partition, offset in stored.items():
            store.offsets[(consumer_group, topic, partition)] = offset
        canon = _one_object_per_hash(store)
        with cur.copy(
            "COPY (SELECT model, group_idx, block_hash, instance, medium, ownership, "
            "refcount FROM kvledger.residencies) TO STDOUT (FORMAT BINARY)"
        ) as copy:
            copy.set_types(["text", "int4", "bytea", "text", "text", "text", "int4"])
            for model, group, raw, instance, medium, own, refcount in copy.rows():
                h = canon(raw)
                store.hold(ResidencyKey(model, group, h, instance, medium, own), refcount)
        _load_blocks(cur, store, canon, clock)
        del canon
        store.set_clock(clock)
        store.sources.update(load_source_states(cur))
        store.lives.update(load_source_lives(cur))
    return store


def _load_blocks(
    cur: psycopg.Cursor, store: RouterStore, canon: Callable[[bytes], bytes], clock: int
) -> None:
    with cur.copy(
        "COPY (SELECT model, group_idx, block_hash, parent_hash, token_start, block_size, "
        "partial, lora_name, extra_keys, token_ids, "
        "GREATEST(0, LEAST(floor(extract(epoch FROM last_seen)), 4294967295))::int8 "
        "FROM kvledger.blocks) TO STDOUT (FORMAT BINARY)"
    ) as copy:
        copy.set_types(
            [
                "text",
                "int4",
                "bytea",
                "bytea",
                "int8",
                "int4",
                "bool",
                "text",
                "text",
                "int4[]",
                "int8",
            ]
        )
        for model, group, raw, up, start, size, partial, lora, extra, tokens, seen in copy.rows():
            h = canon(raw)
            parent = canon(up) if up is not None else None
            plain, salt = walkable(extra, up is None)
            g = store.group(GroupKey(model, group))
            g.set_clock(min(seen, clock))
            g.add_row(h, parent, start, tokens, size, partial, lora, plain, salt)


def _one_object_per_hash(store: RouterStore) -> Callable[[bytes], bytes]:
    """What a snapshot hands the groups for each hash it reads. Pure-Python groups keep
    the objects they are given: one bytes object per hash, whichever copy meets it first
    (~48 bytes saved per parent link and per mask key; the residencies come first, so the
    holder masks, which every lookup probes, keep the objects allocated alongside them).
    The compiled core copies each hash in: sharing would only keep every object alive
    until the load ends."""
    if store.copies_hashes():
        return lambda raw: raw
    seen: dict[bytes, bytes] = {}
    return lambda raw: seen.setdefault(raw, raw)
