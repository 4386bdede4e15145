"""The router's fast lane (consumer.router.lane) leaves the store the planner leaves, and a
group's whole-event calls (store_run / release_run) answer alike compiled and pure."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvledger.consumer.inbound import Inbound
from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import GroupSpec
from kvledger.serving.router import groups
from kvledger.serving.router.lane import run_router_batch
from kvledger.serving.router.store import RouterStore
from tests.helpers.group_kinds import KINDS, use_group_kind
from tests.helpers.pure_router import event_runs
from tests.helpers.pure_router.group import PureGroup
from tests.helpers.streams import (
    Stream,
    cleared,
    edge_stream,
    fleet_stream,
    messy_stream,
    spec,
    stored,
)


@pytest.fixture(params=KINDS)
def group_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    use_group_kind(request.param, monkeypatch)
    return str(request.param)


def state(store: RouterStore) -> dict[str, Any]:
    """Everything the store holds, holder ids named."""
    blocks = {
        (key, h): (g.row(h), g.meta(h)) for key, g in store.groups.items() for h in g.hashes()
    }
    held = {
        (key, h, store.holders[hid]): count
        for key, g in store.groups.items()
        for h, hid, count in g.residencies()
    }
    return {
        "blocks": blocks,
        "held": held,
        "holders": sorted(store.holders),
        "sources": dict(store.sources),
        "lives": dict(store.lives),
        "specs": dict(store.specs),
        "offsets": dict(store.offsets),
    }


def both_ways(messages: list[Inbound], chunk: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    codec, planned, laned, fast = Codec(), RouterStore(), RouterStore(), 0
    for i in range(0, len(messages), chunk):
        run_batch(messages[i : i + chunk], codec, planned, "g")
        fast += run_router_batch(messages[i : i + chunk], codec, laned, "g").fast
    return state(planned), state(laned), fast


@pytest.mark.parametrize("chunk", [1, 7, 500])
def test_the_lane_leaves_the_store_the_planner_leaves(group_kind: str, chunk: int) -> None:
    streams = [edge_stream(), fleet_stream(FleetConfig(instances=3, requests=40, seed=9))]
    streams += [messy_stream(seed) for seed in range(6)]
    took = 0
    for stream in streams:
        planned, laned, fast = both_ways(stream.messages, chunk)
        assert laned == planned
        took += fast
    assert took > 1000  # the lane was taken (else this compares the planner with itself)


def test_a_spec_announced_after_its_stores_is_met_in_order(group_kind: str) -> None:
    """Messages the planner takes and messages the lane takes, interleaved in one batch,
    each meet what every message before them left."""
    s = Stream()
    s.send("e", spec(0, block=4, hash_size=4))
    s.send("e", stored([1, 2]))
    s.send("e", stored([5], group=3))  # unknown_group: the planner's, rejected
    s.send("e", GroupSpec("m", 3, "full_attention", 4, 4))
    s.send("e", stored([5], group=3))
    s.send("e", stored([3], parent=2, start=None))
    s.send("e", cleared(medium="CPU", group=0))
    s.send("e", stored([1, 2]))
    planned, laned, fast = both_ways(s.messages, 100)
    assert laned == planned
    # The lane takes a stream's store once the store knows its holder and group: block 3
    # and the last store; the first store of each holder and group is the planner's.
    assert fast == 2


# ---------------------------------------------------------------------- the group calls
def _random_event(rng: random.Random) -> tuple[Any, ...]:
    n = rng.randint(1, 4)
    first = rng.randrange(10)
    keys = [(first + k).to_bytes(rng.choice([8, 8, 3]), "big") for k in range(n)]
    if rng.random() < 0.05:
        keys.append(keys[0])
    parent = rng.choice([None, None, (first + 40).to_bytes(8, "big"), b""])
    size = rng.choice([0, 2, 4, 4, 4, -1])
    tokens = [] if size <= 0 else [rng.randrange(4) for _ in range(size * n)]
    if size > 0 and rng.random() < 0.1:
        tokens = tokens[: -rng.randint(1, size)]  # fewer tokens than the blocks take
    start = rng.choice([None, 0, 4 * first])
    lora = rng.choice([None, "x", "y"])
    return (keys, parent, start, tokens, max(size, -1), rng.random() < 0.2, lora)


def _group_state(g: Any) -> tuple[Any, ...]:
    return (
        sorted((h, g.row(h), g.meta(h)) for h in g.hashes()),
        sorted(g.residencies()),
    )


def test_store_run_and_release_run_agree_compiled_and_pure() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        compiled, pure = groups.Group(), PureGroup()
        for _ in range(120):
            hid, reports = rng.randrange(3), rng.random() < 0.3
            if rng.random() < 0.65:
                args = _random_event(rng)
                got = [g.store_run(*args, hid, reports) for g in (compiled, pure)]
            else:
                hashes = [rng.randrange(14).to_bytes(8, "big") for _ in range(rng.randint(1, 3))]
                got = [g.release_run(hashes, hid) for g in (compiled, pure)]
            assert got[0] == got[1], (seed, got)
            assert _group_state(compiled) == _group_state(pure), seed


def test_store_run_declines_what_the_rules_decide() -> None:
    g = PureGroup()
    one = (1).to_bytes(8, "big")
    assert event_runs.store_run(g, [one], None, 0, [1, 2], 2, False, None, 0, False) == 0
    # the same content again, by another holder: applied
    assert event_runs.store_run(g, [one], None, 0, [1, 2], 2, False, "x", 1, False) == 0
    assert g.meta(one) == ("x", True, None)
    # other tokens, another position, no position: declined, nothing changed
    before = _group_state(g)
    for tokens, start in (([1, 3], 0), ([1, 2], 4)):
        assert event_runs.store_run(g, [one], None, start, tokens, 2, False, None, 2, False) is None
    twice = event_runs.store_run(g, [one, one], None, 0, [1, 2, 1, 2], 2, False, None, 2, False)
    assert twice is None
    assert _group_state(g) == before
    # a reuse report of a held block adds no reference
    assert event_runs.store_run(g, [one], None, 0, [1, 2], 2, False, None, 0, True) == 1
    assert g.refcount(one, 0) == 1
    assert event_runs.release_run(g, [one, one], 0) == 1  # the second finds none left


@pytest.mark.parametrize("compiled", [True, False])
def test_store_run_declines_a_store_naming_its_parent_among_its_hashes(compiled: bool) -> None:
    """A block would be its own ancestor: the rules decide it (declined, nothing changed),
    wherever among the hashes the parent is, compiled and pure alike."""
    g = groups.Group() if compiled else PureGroup()
    keys = [k.to_bytes(8, "big") for k in range(1, 40)]
    for at in (0, 5, 38):
        assert g.store_run(keys, keys[at], None, list(range(78)), 2, False, None, 0, False) is None
    assert list(g.hashes()) == []
    assert g.store_run(keys[1:], keys[0], 2, list(range(76)), 2, False, None, 0, False) == 0
    assert list(g.hashes()) == keys[1:]  # the stored blocks (not the parent)


def test_a_placeholder_keeps_a_size_zero_rows_tokens_compiled_and_pure() -> None:
    """Found by fuzzing: a placeholder store over a row of block size 0 that has tokens
    stores the row again as it is, tokens included, in both twins."""
    one = (1).to_bytes(8, "big")
    states = []
    for g in (groups.Group(), PureGroup()):
        g.add_row(one, None, 2, [3, 1, 2], 0, True, None, True)
        assert g.store_run([one], None, None, [], 0, False, None, 5, False) == 0
        states.append(_group_state(g))
        assert g.row(one) == (None, 2, (3, 1, 2), 0, True)
    assert states[0] == states[1]
