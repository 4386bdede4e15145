"""The router's store and matches (consumer.router), without services: the same streams
through the router store and the memory store hold the same residencies, and the in-memory
prefix walk agrees with a brute-force one."""

from __future__ import annotations

import dataclasses
import gc
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvledger.consumer.core.model import GroupKey, ResidencyKey, SourceLife
from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts
from kvledger.schemas.codec import Codec
from kvledger.serving.router import match as m
from kvledger.serving.router.index import APPLY_CHUNK, RouterIndex
from kvledger.serving.router.lane import Tally, run_router_batch
from kvledger.serving.router.store import RouterStore
from tests.helpers.group_kinds import KINDS, use_group_kind
from tests.helpers.memory_store import MemoryStore
from tests.helpers.streams import edge_stream, fleet_stream

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def both(messages: list, batch: int = 50) -> tuple[RouterStore, MemoryStore]:  # type: ignore[type-arg]
    router, memory, codec = RouterStore(), MemoryStore(), Codec()
    for i in range(0, len(messages), batch):
        run_batch(messages[i : i + batch], codec, router, "g")
        run_batch(messages[i : i + batch], codec, memory, "g")
    return router, memory


@pytest.fixture(autouse=True, params=KINDS)
def group_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on the compiled core's groups and on the pure ones."""
    use_group_kind(request.param, monkeypatch)
    return str(request.param)


def router_residencies(store: RouterStore) -> dict[ResidencyKey, int]:
    return {
        ResidencyKey(model, group, h, *store.holders[hid]): count
        for (model, group), g in store.groups.items()
        for h, hid, count in g.residencies()
    }


def test_the_router_store_holds_what_the_memory_store_holds() -> None:
    for stream in (edge_stream(), fleet_stream(FleetConfig(instances=3, requests=40, seed=9))):
        router, memory = both(stream.messages)
        assert router_residencies(router) == {k: r.refcount for k, r in memory.residencies.items()}
        assert {
            (model, group, h): g.row(h)
            for (model, group), g in router.groups.items()
            for h in g.hashes()
        } == {k: tuple(r) for k, r in memory.blocks.items()}
        assert router.lives == memory.lives and router.sources == memory.sources
        for g in router.groups.values():  # each held hash's token end is its block's
            for h, _, _ in g.residencies():
                assert {end for _, _, end in g.runs([h])} == {g.end_of(h)}


def brute_force(store: RouterStore, model: str, hashes: list[bytes]) -> set[tuple[int, int]]:
    g = store.groups[(model, 0)]  # type: ignore[index]
    out = set()
    for hid in range(len(store.holders)):
        n = 0
        while n < len(hashes) and g.refcount(hashes[n], hid):
            n += 1
        if n:
            out.add((hid, n))
    return out


def test_prefix_walks_agree_with_brute_force() -> None:
    fleet = FleetConfig(instances=4, requests=60, seed=12, gpu_capacity_blocks=64)
    router, _ = both(fleet_stream(fleet).messages, batch=500)
    rng = random.Random(3)
    systems = system_prompts(fleet)
    matched = 0
    for _ in range(300):
        prompt = rng.choice(systems)
        tokens = prompt[: rng.randrange(0, len(prompt) + 1)] + [rng.randrange(9) for _ in range(40)]
        hashes = prompt_hashes(tokens, fleet, int64=False)  # the collected events keep digests
        found = m.held_prefix(router, fleet.model, 0, hashes, "block")
        assert {(hid, n) for hid, n, _ in found} == brute_force(router, fleet.model, hashes)
        by_tokens = m.held_tokens(router, fleet.model, 0, tokens, None)
        raw = prompt_hashes(tokens, fleet, int64=False, per_hash=True)
        by_hash = m.held_prefix(router, fleet.model, 0, raw, "hash")
        # A token walk finds what the hashes find (no extra keys, no LoRA in this fleet).
        assert {(hid, b) for hid, b, _ in by_tokens} == {(hid, b) for hid, b, _ in found}
        assert all({h: t for h, _, t in by_hash}[hid] >= t for hid, _, t in found)
        matched += bool(found)
    assert matched > 100


def test_source_states() -> None:
    window = timedelta(seconds=30)
    life = SourceLife("m", 1, NOW - timedelta(seconds=10))
    assert m.state_of(None, NOW, window) == "unknown"
    assert m.state_of(life, NOW, window) == "live"
    assert m.state_of(life, NOW + window, window) == "silent"
    closed = SourceLife("m", 1, NOW, closed_at=NOW)
    assert m.state_of(closed, NOW, window) == "closed"


def test_a_block_learnt_after_its_holder_gives_its_token_end() -> None:
    """As a bootstrap loads them (residencies first) or a placeholder is filled in later."""
    store = RouterStore()
    h, parent = b"\x01" * 8, b"\x02" * 8
    store.hold(ResidencyKey("m", 0, h, "e1", "GPU", ""), 1)
    g = store.groups[GroupKey("m", 0)]
    assert g.runs([h]) == [(0, 1, 0)]  # no block yet: no token end
    g.add_row(h, parent, 16, list(range(16)), 16, False, None, True)
    assert g.runs([h]) == [(0, 1, 32)]
    store.hold(ResidencyKey("m", 0, h, "e1", "GPU", ""), 0)
    store.hold(ResidencyKey("m", 0, h, "e2", "CPU", ""), 1)  # held anew: the end is found again
    assert g.runs([h]) == [(1, 1, 32)]


def test_apply_pauses_the_collector_per_chunk_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RouterIndex.apply runs each chunk with Python's cycle collector off (the pipeline
    makes no cycles), turns it back on after every chunk, even one that raises, and leaves a
    collector its process turned off alone. The applied index equals the router store fed
    by run_batch directly."""
    messages = fleet_stream(FleetConfig(instances=2, requests=40, seed=3), partitions=1).messages
    seen: list[bool] = []

    def watching(*args: Any, **kwargs: Any) -> Tally:
        seen.append(gc.isenabled())
        return run_router_batch(*args, **kwargs)

    def failing(*args: Any, **kwargs: Any) -> Tally:
        raise RuntimeError("a bug")

    direct = RouterStore()
    run_batch(messages, Codec(), direct, "g")
    router = RouterIndex("localhost:1", "fleet", "g")  # never connects
    monkeypatch.setattr("kvledger.serving.router.index.run_router_batch", watching)
    assert gc.isenabled()
    router.apply(messages)
    assert gc.isenabled() and seen and not any(seen)
    assert len(seen) == -(-len(messages) // APPLY_CHUNK)
    assert router_residencies(router.store) == router_residencies(direct)
    assert router.applied_messages == len(messages)

    monkeypatch.setattr("kvledger.serving.router.index.run_router_batch", failing)
    with pytest.raises(RuntimeError):
        RouterIndex("localhost:1", "fleet", "g").apply(messages)
    assert gc.isenabled()

    monkeypatch.setattr("kvledger.serving.router.index.run_router_batch", watching)
    seen.clear()
    gc.disable()
    try:
        RouterIndex("localhost:1", "fleet", "g").apply(messages[:10])
        assert not gc.isenabled() and seen == [False]
    finally:
        gc.enable()


def test_a_router_forgets_unheld_blocks_past_its_retention_and_answers_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RouterIndex.expire forgets, past the block retention, the blocks no one holds and no
    kept block names as its parent (leaves first, then their parents), and nothing sooner,
    a slice of rows per hold of the lock; every lookup answers as before, and what it
    forgot is stored again as new."""
    fleet = FleetConfig(instances=3, requests=60, seed=5, gpu_capacity_blocks=48)
    messages = fleet_stream(fleet, partitions=1).messages
    clock = [10_000]
    monkeypatch.setattr("kvledger.serving.router.index._clock", lambda: clock[0])
    monkeypatch.setattr("kvledger.serving.router.index.EXPIRY_SLICE", 50)  # many slices
    router = RouterIndex("localhost:1", "fleet", "g", block_retention=timedelta(seconds=60))
    router.apply(messages[: len(messages) // 2])
    clock[0] += 30
    router.apply(messages[len(messages) // 2 :])
    everything = router.store.groups.items()
    held = {(k, h) for k, g in everything for h, _, _ in g.residencies()}
    unheld = {(k, h) for k, g in everything for h in g.hashes()} - held
    assert unheld, "the fleet's engines evicted blocks"
    rng = random.Random(4)
    systems = system_prompts(fleet)
    asked = [rng.choice(systems)[: rng.randrange(16, 1200)] for _ in range(200)]

    def answers() -> list[object]:
        return [
            (m.held_tokens(router.store, fleet.model, 0, tokens, None),
             m.held_prefix(router.store, fleet.model, 0,
                           prompt_hashes(tokens, fleet, int64=False), "block"))
            for tokens in asked
        ]  # fmt: skip

    before = answers()
    clock[0] += 40  # the first half's blocks are 70 s old, the second half's 40 s
    first = router.expire(force=True)
    clock[0] += 30
    second = router.expire(force=True)
    assert first > 0 and second > 0 and router.blocks_expired == first + second
    kept = {(k, h) for k, g in everything for h in g.hashes()}
    parents = {(k, g.row(h)[0]) for k, g in everything for h in g.hashes()}  # type: ignore[index]
    assert held <= kept and all(x in held or x in parents for x in kept)
    assert len(unheld - kept) == first + second
    assert answers() == before
    assert router.expire(force=True) == 0
    # The same fleet again: blocks it forgot come back as new ones, and the router holds
    # what a router that never forgot holds.
    again = [
        dataclasses.replace(x, offset=x.offset + len(messages))
        for x in fleet_stream(fleet, partitions=1).messages
    ]
    router.apply(again)
    direct = RouterStore()
    run_batch(messages + again, Codec(), direct, "g")
    assert router_residencies(router.store) == router_residencies(direct)


def test_a_flood_of_health_checks_asks_the_broker_once_a_second() -> None:
    """Each unauthenticated /healthz from memory asked the broker for the log's end (582 a
    second from one client): now the last answer stands for LOG_END_REFRESH_S."""

    class Counted(RouterIndex):
        asked = 0

        def _log_end(self) -> dict[int, int]:
            Counted.asked += 1
            return {0: 7}

    router = Counted("127.0.0.1:9", "t", "g")  # never started: no broker is reached
    answers = [router.position() for _ in range(500)]
    assert Counted.asked == 1 and all(p.log_end == {0: 7} for p in answers)
