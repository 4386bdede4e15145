"""One suite per interface, every implementation one parameter: a new implementation joins
by adding itself to ``STORES`` or ``LOOKUPS``.

**Stores** (what the consumer applies into): the memory store, the PostgreSQL store (a real
server; also with each batch planned while the one before it is written, as the consumer
runs it: consumer/ahead.py) and the router index (the compiled groups, as `serve --memory`
and `republish` apply a topic). Each takes the differential streams (every rule's edge
cases, a simulated fleet, random messy streams) in batches of its own size and must end
holding exactly what the oracle holds: the memory store fed each stream whole, itself
held to the independent reference model of the index on the fleet
(:func:`test_the_oracle_is_the_reference_model`).
Stores that keep history, rejections and lives (memory, PostgreSQL) must equal the oracle
table by table, and again after a group declared late and their dead letters replayed.

**Prefix lookups** (:class:`~kvledger.serving.lookup.api.PrefixLookups`, what the service
asks): SQL, the router bootstrapped from that database (as `serve --memory` starts), and
the router that applied the stream itself. Each answers every prompt as the brute-force
walks of the reference model do: by block hashes, by the engine's hashes, by token content.
"""

from __future__ import annotations

import contextlib
import random
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvledger.consumer.admin import declare_group
from kvledger.consumer.admin import replay as replay_postgres
from kvledger.consumer.ahead import apply_in_turn
from kvledger.consumer.db import connect, create_database, drop_database, migrate
from kvledger.consumer.inbound import decode
from kvledger.consumer.pipeline import replay_batch, run_batch
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.consumer.verify import diff
from kvledger.consumer.verify import dump as dump_postgres
from kvledger.fleet import FleetConfig, prompt_hashes
from kvledger.schemas.events import Goodbye, Heartbeat
from kvledger.schemas.lookup import EngineLoad
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.router.index import RouterIndex
from tests.helpers.brute_force import (
    BLOCK,
    MODEL,
    brute_force,
    brute_force_hashes,
    chain_by_tokens,
    held_now,
    prompts,
)
from tests.helpers.memory_store import MemoryStore
from tests.helpers.reference_index import Reference, build
from tests.helpers.streams import MODEL as STREAM_MODEL
from tests.helpers.streams import Stream, edge_stream, fleet_stream, messy_stream, spec

pytestmark = pytest.mark.integration

Held = dict[tuple[object, ...], int]  # (model, group, hash, instance, medium, ownership) -> copies
Tables = dict[str, Counter[tuple[object, ...]]]
FLEET = FleetConfig(instances=4, requests=60, seed=11, misconfigured_source=True)
STREAMS: dict[str, Callable[[], Stream]] = {
    "edge cases": edge_stream,
    "simulated fleet": lambda: fleet_stream(FLEET, partitions=3),
    **{f"messy {seed}": (lambda seed=seed: messy_stream(seed)) for seed in range(3)},
}


def reference_of(stream: Stream) -> Reference:
    """The reference model of a stream (it reads partition by partition)."""
    by_partition: dict[int, list[bytes]] = defaultdict(list)
    for m in sorted(stream.messages, key=lambda m: (m.partition, m.offset)):
        by_partition[m.partition].append(m.value)
    return build(by_partition)


@contextlib.contextmanager
def new_database(admin_url: str) -> Iterator[str]:
    """A migrated database of the test's own, dropped afterwards."""
    name = f"kvl_conf_{uuid.uuid4().hex[:12]}"
    url = create_database(admin_url, name)
    try:
        migrate(url)
        yield url
    finally:
        drop_database(admin_url, name)


def held_of(tables: Tables) -> Held:
    """The live residencies of a table dump, with their copy counts."""
    return {row[:6]: row[-1] for row in tables["residencies"]}  # type: ignore[misc]


# ---------------------------------------------------------------------- stores
def feed(store: Any, stream: Stream, batch: int) -> None:
    """The stream through the consumer's pipeline into ``store``, ``batch`` at a time."""
    for i in range(0, len(stream.messages), batch):
        run_batch(stream.messages[i : i + batch], stream.codec, store, "g")


def apply_memory(stream: Stream, batch: int, _: str) -> tuple[Held, Tables | None]:
    store = MemoryStore()
    feed(store, stream, batch)
    tables = store.dump()
    return held_of(tables), tables


def apply_postgres(stream: Stream, batch: int, admin_url: str) -> tuple[Held, Tables | None]:
    with new_database(admin_url) as database, connect(database, autocommit=True) as conn:
        feed(PostgresStore(conn), stream, batch)
        tables = dump_postgres(conn)
    return held_of(tables), tables


class HeldOpen(PostgresStore):
    """A writer that keeps each batch's transaction open until the next batch's load has
    run (or a short wait passes: the last batch, or one planned after the commit): every
    plan ahead then reads what the batch in flight has not committed, which only the
    overlay (consumer/ahead.py) puts right."""

    def __init__(self, conn: Any, loaded: threading.Event) -> None:
        super().__init__(conn)
        self.loaded = loaded

    def write(self, *args: Any, **kwargs: Any) -> None:
        super().write(*args, **kwargs)
        self.loaded.wait(0.2)
        self.loaded.clear()


class Signalling(PostgresStore):
    def __init__(self, conn: Any, loaded: threading.Event) -> None:
        super().__init__(conn)
        self.loaded = loaded

    def load(self, needs: Any) -> Any:
        snap = super().load(needs)
        self.loaded.set()
        return snap


def apply_postgres_ahead(stream: Stream, batch: int, admin_url: str) -> tuple[Held, Tables | None]:
    loaded = threading.Event()
    with (
        new_database(admin_url) as database,
        connect(database, autocommit=True) as conn,
        connect(database, autocommit=True) as reads,
    ):
        batches = (stream.messages[i : i + batch] for i in range(0, len(stream.messages), batch))
        for _ in apply_in_turn(batches, stream.codec, HeldOpen(conn, loaded),
                               Signalling(reads, loaded), "g"):  # fmt: skip
            pass
        tables = dump_postgres(conn)
    return held_of(tables), tables


def apply_router(stream: Stream, batch: int, _: str) -> tuple[Held, Tables | None]:
    router = RouterIndex("127.0.0.1:9", stream.topic, "g")  # never started: fed here
    for i in range(0, len(stream.messages), batch):
        router.apply(stream.messages[i : i + batch])
    store, held = router.store, {}
    for (model, group), g in store.groups.items():
        for h, hid, count in g.residencies():
            held[(model, group, h, *store.holders[hid])] = count
    return held, None  # the router keeps what lookups need: no history, no rejections


STORES: dict[str, Callable[[Stream, int, str], tuple[Held, Tables | None]]] = {
    "memory": apply_memory,
    "postgres": apply_postgres,
    "postgres ahead": apply_postgres_ahead,
    "router": apply_router,
}


@pytest.mark.parametrize("stream_name", list(STREAMS))
@pytest.mark.parametrize("store", list(STORES))
def test_a_store_holds_what_the_oracle_holds(
    store: str, stream_name: str, request: pytest.FixtureRequest
) -> None:
    stream = STREAMS[stream_name]()
    admin_url = request.getfixturevalue("database_url") if store.startswith("postgres") else ""
    want_held, want_tables = apply_memory(stream, len(stream.messages), "")
    for batch in (7, 500):
        held, tables = STORES[store](stream, batch, admin_url)
        assert held == want_held, {
            "only here": sorted(set(held.items()) - set(want_held.items()))[:5],
            "only in the oracle": sorted(set(want_held.items()) - set(held.items()))[:5],
        }
        if tables is not None:
            assert want_tables is not None
            differences = diff(tables, want_tables)
            assert not differences, [
                (d.table, d.only_live[:2], d.only_rebuilt[:2]) for d in differences
            ]
    assert want_held  # every stream leaves something held


def test_the_oracle_is_the_reference_model() -> None:
    """The memory store, fed the fleet whole, is what the independent reference model
    computes from the events alone (the fleet uses only rules the model states)."""
    stream = STREAMS["simulated fleet"]()
    ref = reference_of(stream)
    held, tables = apply_memory(stream, len(stream.messages), "")
    assert tables is not None
    assert held == ref.residencies()
    rejected = Counter(row[5] for row in tables["rejected_events"])
    assert rejected == ref.rejected and sum(rejected.values()) > 0
    history = Counter((*row[:6], row[7], row[8]) for row in tables["residency_history"])
    assert history == ref.history_multiset()  # closed and open intervals alike


# ---------------------------------------------------------------------- dead letters
LATE_GROUP = spec(7)  # the edge stream's events for it are rejected until it is declared


def replay_memory(stream: Stream, batch: int, _: str) -> Tables:
    """The memory store after the stream, the late group's declaration and what ``kvledger
    dlq replay`` does: pending rejections in log order, stale epochs left out."""
    store = MemoryStore()
    feed(store, stream, batch)
    store.declare(LATE_GROUP)
    pending = sorted(
        (r.message for r, replayed in store.rejected.values()
         if not replayed and r.reason != "stale_epoch"),
        key=lambda m: (m.topic, m.partition, m.offset),
    )  # fmt: skip
    replay_batch([decode(m, stream.codec) for m in pending if m.value], store)
    return store.dump()


def replay_in_postgres(stream: Stream, batch: int, admin_url: str) -> Tables:
    with new_database(admin_url) as database, connect(database, autocommit=True) as conn:
        feed(PostgresStore(conn), stream, batch)
        declare_group(conn, LATE_GROUP)
        replay_postgres(conn)
        return dump_postgres(conn)


REPLAYING: dict[str, Callable[[Stream, int, str], Tables]] = {
    "memory": replay_memory,
    "postgres": replay_in_postgres,
}


@pytest.mark.parametrize("stream_name", ["edge cases", "simulated fleet"])
@pytest.mark.parametrize("store", list(REPLAYING))
def test_a_store_replays_its_dead_letters_as_the_oracle_does(
    store: str, stream_name: str, request: pytest.FixtureRequest
) -> None:
    stream = STREAMS[stream_name]()
    admin_url = request.getfixturevalue("database_url") if store.startswith("postgres") else ""
    want = replay_memory(stream, len(stream.messages), "")
    differences = diff(REPLAYING[store](stream, 7, admin_url), want)
    assert not differences, [(d.table, d.only_live[:2], d.only_rebuilt[:2]) for d in differences]
    # The streams exercise what they should.
    assert len(want["residencies"]) >= 6 and len(want["residency_history"]) >= 8
    assert len(want["rejected_events"]) >= (8 if stream_name == "edge cases" else 1)
    if stream_name == "edge cases":
        assert {(row[0], row[3]) for row in want["lifecycle_events"]} == {
            ("engine-c", "restart"), ("engine-b", "closed"), ("engine-a", "restart"),
            ("engine-c", "lost"),
        }  # fmt: skip
        assert len(want["sources"]) == 4
        assert ("reported_reuse", 2) in {(row[14], row[12]) for row in want["events"]}
        assert {row[13] for row in want["events"]} == {"applied", "rejected", "duplicate"}


# ---------------------------------------------------------------------- lookups
LOOKUP_FLEET = FleetConfig(instances=5, requests=80, seed=31)
WIDE = timedelta(days=36_500)  # the stream's sources went silent long ago: left in


@pytest.fixture(scope="module")
def filled(database_url: str) -> Iterator[tuple[Stream, Reference, str]]:
    """The lookup fleet applied to a database of its own, and the reference model of it."""
    stream = fleet_stream(LOOKUP_FLEET, partitions=3)
    with new_database(database_url) as database:
        with connect(database, autocommit=True) as conn:
            feed(PostgresStore(conn), stream, 500)
        yield stream, reference_of(stream), database


def sql_lookups(stream: Stream, database: str) -> Iterator[Any]:
    with connect(database, autocommit=True) as conn:
        yield PrefixIndex(conn)


def bootstrapped_lookups(stream: Stream, database: str) -> Iterator[Any]:
    router = RouterIndex("127.0.0.1:9", stream.topic, "g")
    with connect(database) as conn:
        router.bootstrap(conn)
    yield router


def applied_lookups(stream: Stream, database: str) -> Iterator[Any]:
    router = RouterIndex("127.0.0.1:9", stream.topic, "g")
    router.apply(stream.messages)
    yield router


LOOKUPS: dict[str, Callable[[Stream, str], Iterator[Any]]] = {
    "sql": sql_lookups,
    "memory, bootstrapped": bootstrapped_lookups,
    "memory, applied": applied_lookups,
}


def _found(holders: list[Any]) -> set[tuple[str, str, str, int, int]]:
    return {(h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens)
            for h in holders}  # fmt: skip


@pytest.mark.parametrize("lookups", list(LOOKUPS))
def test_lookups_answer_as_the_brute_force_walks(
    lookups: str, filled: tuple[Stream, Reference, str]
) -> None:
    stream, ref, database = filled
    held = held_now(ref)
    asked = partial = 0
    for idx in LOOKUPS[lookups](stream, database):
        for tokens in prompts(ref, LOOKUP_FLEET, random.Random(99)):
            hashes = prompt_hashes(tokens, LOOKUP_FLEET, int64=False)  # the stream's own
            want = brute_force(ref, hashes, held)
            got = idx.match(MODEL, 0, hashes, "block", True, WIDE)
            assert _found(got) == _found(list(want)), tokens[:8]
            raw = prompt_hashes(tokens, LOOKUP_FLEET, int64=False, per_hash=True)
            by_hash = idx.match(MODEL, 0, raw, "hash", True, WIDE)
            assert _found(by_hash) == _found(list(brute_force_hashes(raw, held)))
            chain, full = chain_by_tokens(ref, tokens)
            by_tokens = idx.match_tokens(MODEL, 0, tokens, None, True, WIDE)
            assert _found(by_tokens) == {
                (h.instance, h.medium, h.ownership, min(h.matched_blocks, full),
                 h.matched_tokens)
                for h in brute_force(ref, chain, held)
            }  # fmt: skip
            asked += bool(want)
            partial += any(h.matched_tokens % BLOCK for h in by_tokens)
    assert asked >= 20 and partial >= 3  # the prompts reached holders and partial tails


def load_stream() -> Stream:
    """Engines whose heartbeats said their load, and the lives that end it."""
    s = Stream(partitions=3)
    for source in ("engine-a", "engine-b", "engine-c", "engine-d"):
        s.send(source, spec(0))
    s.send("engine-e", spec(0), model="another")
    s.send("engine-a", Heartbeat(0, 1000, 3, 1), time_ms=1_000_000)
    s.send("engine-b", Heartbeat(0, 1000, 0, 0), time_ms=2_000_000)
    s.send("engine-b", Heartbeat(0, 1000), time_ms=3_000_000)  # no reading: the last kept
    s.send("engine-c", Heartbeat(0, 1000, 5, 5))
    s.send("engine-c", Goodbye())  # closed: no load
    s.send("engine-d", Heartbeat(0, 1000, 1, 1))
    s.send("engine-d", spec(0), epoch=2, seq=0)  # restarted: the new process has not said
    s.send("engine-e", Heartbeat(0, 1000, 9, 9), model="another")
    return s


@pytest.mark.parametrize("lookups", list(LOOKUPS))
def test_lookups_answer_each_live_engines_load(lookups: str, database_url: str) -> None:
    stream = load_stream()
    at = datetime.fromtimestamp  # a heartbeat's log time
    want = [
        EngineLoad("engine-a", 3, 1, at(1_000, tz=UTC)),
        EngineLoad("engine-b", 0, 0, at(2_000, tz=UTC)),
    ]
    with new_database(database_url) as database:
        with connect(database, autocommit=True) as conn:
            feed(PostgresStore(conn), stream, 4)
        for idx in LOOKUPS[lookups](stream, database):
            assert idx.loads(STREAM_MODEL, WIDE) == want
            assert idx.loads("another", WIDE) == [
                EngineLoad("engine-e", 9, 9, at(stream._clock / 1000, tz=UTC))
            ]
            assert idx.loads(STREAM_MODEL, timedelta(seconds=5)) == []  # all silent by now
