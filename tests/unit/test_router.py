"""The router's store and matches (consumer.router), without services: the same streams
through the router store and the memory store hold the same residencies, and the in-memory
prefix walk agrees with a brute-force one."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from kvledger.consumer.core.model import ResidencyKey, SourceLife
from kvledger.consumer.pipeline import run_batch
from kvledger.consumer.router import match as m
from kvledger.consumer.router.store import RouterStore
from kvledger.consumer.store.memory import MemoryStore
from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts
from kvledger.schemas.codec import Codec
from tests.helpers.streams import edge_stream, fleet_stream

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def both(messages: list, batch: int = 50) -> tuple[RouterStore, MemoryStore]:  # type: ignore[type-arg]
    router, memory, codec = RouterStore(), MemoryStore(), Codec()
    for i in range(0, len(messages), batch):
        run_batch(messages[i : i + batch], codec, router, "g")
        run_batch(messages[i : i + batch], codec, memory, "g")
    return router, memory


def router_residencies(store: RouterStore) -> dict[ResidencyKey, int]:
    out = {}
    for (model, group), g in store.groups.items():
        for h, mask in g.masks.items():
            for hid, (instance, medium, own) in enumerate(store.holders):
                if (mask >> hid) & 1:
                    out[ResidencyKey(model, group, h, instance, medium, own)] = g.counts.get(
                        (h, hid), 1
                    )
    return out


def test_the_router_store_holds_what_the_memory_store_holds() -> None:
    for stream in (edge_stream(), fleet_stream(FleetConfig(instances=3, requests=40, seed=9))):
        router, memory = both(stream.messages)
        assert router_residencies(router) == {k: r.refcount for k, r in memory.residencies.items()}
        assert {
            (model, group, h): (row.parent, row.token_start, row.block_size, row.partial)
            for (model, group), g in router.groups.items()
            for h, row in g.rows.items()
        } == {
            k: (r.parent_hash, r.token_start, r.block_size, r.partial)
            for k, r in memory.blocks.items()
        }
        assert router.lives == memory.lives and router.sources == memory.sources


def brute_force(store: RouterStore, model: str, hashes: list[bytes]) -> set[tuple[int, int]]:
    g = store.groups[(model, 0)]  # type: ignore[index]
    out = set()
    for hid in range(len(store.holders)):
        n = 0
        while n < len(hashes) and (g.masks.get(hashes[n], 0) >> hid) & 1:
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


def test_runs_and_states() -> None:
    assert m.runs([0b111, 0b101, 0b100, 0b110]) == [(1, 1), (0, 2), (2, 4)]
    assert m.runs([0, 0b1]) == [] and m.runs([]) == []
    window = timedelta(seconds=30)
    life = SourceLife("m", 1, NOW - timedelta(seconds=10))
    assert m.state_of(None, NOW, window) == "unknown"
    assert m.state_of(life, NOW, window) == "live"
    assert m.state_of(life, NOW + window, window) == "silent"
    closed = SourceLife("m", 1, NOW, closed_at=NOW)
    assert m.state_of(closed, NOW, window) == "closed"
