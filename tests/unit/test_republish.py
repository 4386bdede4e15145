"""`kvledger republish` without sockets: the vLLM maps it makes (read back by the relay's
own decoder), the order it restates blocks in, each source's numbered and retained stream,
and the feed's one promise — a subscriber that heard every output holds, per source,
exactly what the router index holds (on the lane's edge, fleet and messy streams)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from kvledger.consumer.core.model import SourceLife
from kvledger.fleet import FleetConfig
from kvledger.producer.relay.wire import decode_batch
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import BlockRemoved, BlockStored
from kvledger.serving.republish.events import (
    CLEARED,
    Blocks,
    chain_maps,
    encode_batch,
    removed_map,
    stored_map,
)
from kvledger.serving.republish.feed import Feed, Output
from kvledger.serving.republish.publisher import Outlet
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.lane import run_router_batch
from kvledger.serving.router.store import RouterStore
from tests.helpers.group_kinds import KINDS, use_group_kind
from tests.helpers.streams import edge_stream, fleet_stream, messy_stream

# ---------------------------------------------------------------------- events


def test_a_store_and_a_removal_read_back_as_they_were() -> None:
    digest = bytes(range(32))
    ev = BlockStored(
        (b"\x00" * 7 + b"\x05", digest), b"\xff" * 8, tuple(range(8)), 4, None, "CPU", "lora-a",
        group_idx=2, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64,
    )  # fmt: skip
    stored = stored_map(ev)
    assert stored is not None
    assert stored["block_hashes"] == [5, digest]  # vLLM's int hash; a digest stays bytes
    assert stored["parent_block_hash"] == (1 << 64) - 1
    gone = removed_map(BlockRemoved((ev.block_hashes[0],), "CPU", group_idx=2), [b"\x00" * 8])
    batch = decode_batch(encode_batch(1.5, [stored, gone or {}], 3))
    assert (batch.ts, batch.dp_rank) == (1.5, 3)
    again, removal = batch.events
    assert again == ev
    assert removal == BlockRemoved((b"\x00" * 8,), "CPU", group_idx=2)


def test_what_has_no_vllm_form_or_ends_nothing_is_not_sent() -> None:
    partial = BlockStored((b"\x01" * 8,), None, (1, 2), 2, None, "GPU", None, partial=True)
    assert stored_map(partial) is None
    assert removed_map(BlockRemoved((b"\x01" * 8,), "GPU"), []) is None
    assert encode_batch(0.0, [CLEARED], None)  # a rank not known: vLLM's None


def test_a_holders_blocks_go_out_as_chains_parents_first() -> None:
    """Random trees of blocks (shared prefixes, as an engine's cache holds them): one store
    per run of single children, each after the run holding its parent; every block once,
    its tokens with it."""
    rng = random.Random(4)
    for _ in range(50):
        n = rng.randint(1, 60)
        parent = {i: (rng.randrange(i) if i and rng.random() < 0.8 else None) for i in range(n)}
        key = {i: i.to_bytes(8, "big") for i in range(n)}
        blocks: Blocks = {
            key[i]: ((key[p] if p is not None else b"outside!", None, (i, i), 2, False), None)
            for i, p in parent.items()
        }
        items = list(blocks.items())
        rng.shuffle(items)
        events = chain_maps(dict(items), "GPU", 0, "")
        at: dict[int, int] = {}
        for k, e in enumerate(events):
            assert e["token_ids"] == [t for h in e["block_hashes"] for t in (h, h)]
            for j, h in enumerate(e["block_hashes"]):
                assert h not in at
                at[h] = k
                want = parent[h]
                if j:  # inside a run: the block before it is its parent
                    assert e["block_hashes"][j - 1] == want
                elif want is None:
                    assert e["parent_block_hash"] == int.from_bytes(b"outside!", "big")
                else:
                    assert e["parent_block_hash"] == want
        assert sorted(at) == list(range(n))
        for i, p in parent.items():
            if p is not None:
                assert at[p] <= at[i]
        # one store per run: a block starts one only under a parent with other children
        kids = [sum(1 for q in parent.values() if q == i) for i in range(n)]
        starts = [h for e in events for h in e["block_hashes"][:1]]
        assert all(parent[h] is None or kids[parent[h]] > 1 for h in starts)


def test_a_cycle_ends_the_walk() -> None:
    a, b = b"a" * 8, b"b" * 8
    blocks: Blocks = {a: ((b, None, (1,), 1, False), None), b: ((a, None, (2,), 1, False), None)}
    hashes = [h for e in chain_maps(blocks, "GPU", 0, "") for h in e["block_hashes"]]
    assert sorted(hashes) == [int.from_bytes(a, "big"), int.from_bytes(b, "big")]


# ---------------------------------------------------------------------- the numbered stream


def test_an_outlet_numbers_densely_and_retains_its_last_batches() -> None:
    outlet = Outlet("e", 1000, True, steps=4, max_bytes=1 << 20)
    seqs = [outlet.number(bytes([i]), starts_snapshot=(i == 1)) for i in range(6)]
    assert seqs == list(range(1000, 1006))
    assert [s for s, _ in outlet.ring] == [1002, 1003, 1004, 1005]
    assert outlet.snapshot_seq is None  # the snapshot at 1001 fell out
    assert outlet.replay(1003) == [(1003, b"\x03"), (1004, b"\x04"), (1005, b"\x05")]
    assert outlet.replay(1006) == [] and outlet.replay(1 << 62) == []  # nothing yet
    assert outlet.replay(0) is None  # older than retained, no snapshot: make one
    outlet.number(b"s", starts_snapshot=True)
    outlet.number(b"t", starts_snapshot=False)
    assert outlet.replay(0) == [(1006, b"s"), (1007, b"t")]  # from the snapshot


def test_an_outlet_keeps_its_bytes_bounded_but_never_empty() -> None:
    outlet = Outlet("e", 0, True, steps=100, max_bytes=10)
    for _ in range(5):
        outlet.number(b"x" * 4, starts_snapshot=False)
    assert outlet.ring_bytes <= 10 and len(outlet.ring) == 2
    outlet.number(b"y" * 50, starts_snapshot=True)
    assert [p for _, p in outlet.ring] == [b"y" * 50]
    assert Outlet("e", 0, False, 100, 10).number(b"z", False) == 0  # no replay: keeps none


# ---------------------------------------------------------------------- the feed's promise


@pytest.fixture(params=KINDS)
def group_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    use_group_kind(request.param, monkeypatch)
    return str(request.param)


Held = set[tuple[int, str, str, int | bytes]]  # (group, medium, ownership, wire hash)


def hear(heard: dict[str, Held], outputs: list[Output]) -> None:
    """A subscriber per source following the outputs."""
    for out in outputs:
        mine = heard.setdefault(out.source, set())
        for e in out.resolved():
            if e["type"] == "AllBlocksCleared":
                mine.clear()
                continue
            key = (e.get("group_idx", 0), e["medium"], e.get("ownership", ""))
            if e["type"] == "BlockStored":
                mine.update((*key, h) for h in e["block_hashes"])
            else:
                mine.difference_update((*key, h) for h in e["block_hashes"])


def held(store: RouterStore, now: datetime) -> dict[str, Held]:
    """What the index holds per live source, as a subscriber would name it."""
    out: dict[str, Held] = {}
    for (_, group_idx), g in store.groups.items():
        for h, hid, _ in g.residencies():
            source, medium, ownership = store.holders[hid]
            life = store.lives.get(source)
            row = g.row(h)
            if life is None or life.closed_at is not None or row is None or row[4]:
                continue  # not live, or a partial block (no vLLM form)
            wire = int.from_bytes(h, "big") if len(h) == 8 else h
            out.setdefault(source, set()).add((group_idx, medium, ownership, wire))
    return out


@pytest.mark.parametrize("chunk", [1, 7, 500])
def test_a_subscriber_holds_what_the_index_holds(group_kind: str, chunk: int) -> None:
    streams = [edge_stream(), fleet_stream(FleetConfig(instances=3, requests=40, seed=9))]
    streams += [messy_stream(seed) for seed in range(6)]
    for stream in streams:
        index = RouterIndex("unused:9092")
        feed = Feed(index, lambda source: True, timedelta(days=36500))
        codec, store, heard = Codec(), index.store, {}
        messages = stream.messages
        for i in range(0, len(messages), chunk):
            run_router_batch(messages[i : i + chunk], codec, store, "g", observer=feed)
            feed.applied()
            feed.tick(feed.known())
            hear(heard, feed.take())
        want = held(store, datetime.now(UTC))
        assert {s: h for s, h in heard.items() if h} == want
        # ... and a snapshot says the same to a subscriber that heard nothing
        late: dict[str, Held] = {}
        hear(late, [feed.snapshot(s) for s in feed.known()])
        assert {s: h for s, h in late.items() if h} == want


def test_a_silent_source_is_cleared_and_restored() -> None:
    index = RouterIndex("unused:9092")
    store = index.store
    run_router_batch(fleet_stream(FleetConfig(instances=2, requests=20, seed=1)).messages,
                     Codec(), store, "g")  # fmt: skip
    now = datetime.now(UTC)
    lives = dict(store.lives)
    for s, life in lives.items():  # each spoke just now
        store.lives[s] = SourceLife(life.model, life.epoch, now)
    source = min(held(store, now))
    feed = Feed(index, lambda s: s == source, timedelta(seconds=30))
    before: dict[str, Held] = {}
    hear(before, [feed.snapshot(source)])
    assert before[source] == held(store, now)[source]
    life = lives[source]
    store.lives[source] = SourceLife(life.model, life.epoch, now - timedelta(minutes=5))
    feed.tick(list(lives))
    feed.tick(list(lives))  # said once
    [cleared] = feed.take()
    assert (cleared.source, cleared.events, cleared.snapshot) == (source, [CLEARED], False)
    store.lives[source] = SourceLife(life.model, life.epoch, now)
    feed.tick(list(lives))
    [restored] = feed.take()
    after: dict[str, Held] = {}
    hear(after, [restored])
    assert restored.snapshot and after == before
    assert feed.known() == [source]  # only the sources it republishes
