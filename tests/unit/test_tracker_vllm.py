"""kvledger's offloading events tracker against vLLM's own, from the 0.33.0 and 0.34.0 wheels
(tests/helpers/vllm_tracker.py), on the same random scenarios: every call made to both, every
batch of raw events translated by both, and the events compared field by field, as are the
offload keys each still keeps a payload for.

A scenario mixes full-attention groups at two block sizes, a sliding-window group (always a
placeholder), a recurrent (Mamba) group (a placeholder under 0.33, state checkpoints under
0.34), requests sharing a prefix, a LoRA request, a resumable request and a truncated
prefill; stores and lookups of whole chunks and of partial tails; 0.34's request contexts
with the end positions the scheduler records (aligned or not); store and removal batches on
the primary and two secondary tiers, with and without a removal expected, metadata-only
removals, resets; the tracker on or off; and under 0.34 a hash look-ahead of 0 or 2 tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.producer.tracker import (
    GroupOffloadConfig,
    Locality,
    Medium,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    RequestContext,
    make_offload_key,
)
from tests.helpers.vllm_tracker import VERSIONS, vllm_tracker
from tests.unit.test_tracker import Lora
from tests.unit.test_tracker import Req as TrackerReq

pytestmark = pytest.mark.downloads  # the vLLM wheels, once, from the package index

HASH = 8  # tokens per hash: one hash size for every group, as in an engine
TOKENS = 264  # 4 chunks of 64 and 8 tokens after them, for look-ahead
# group -> (tokens per block, tokens per chunk, kind, sliding window in chunks)
GROUPS = {
    0: (16, 64, "full_attention", None),
    1: (8, 32, "full_attention", None),
    2: (16, 64, "sliding_window", 2),
    3: (32, 64, "mamba", 1),
}
TIERS = [("CPU", None, None), ("STORAGE", "disk", "LOCAL"), ("STORAGE", "remote", "REMOTE")]


@dataclass
class Req(TrackerReq):
    """The tracker tests' request, with what vLLM 0.34 also reads of one."""

    resumable: bool = False
    kv_transfer_params: dict[str, Any] | None = None


def _request(salt: int, shared: int = 0, **kw: Any) -> Req:
    """A request whose first ``shared`` hashes (and tokens) are request 0's."""
    hashes = [bytes([0 if i < shared else salt]) + i.to_bytes(7, "big") for i in range(33)]
    tokens = [(0 if i < shared * HASH else salt) * 1000 + i for i in range(TOKENS)]
    return Req(hashes, tokens, **kw)


REQUESTS = [
    _request(0),
    _request(1, shared=8),  # the first chunk of groups 0, 2 and 3 is request 0's
    _request(2, lora_request=Lora(7, "adapter-7")),
    _request(3, resumable=True),
    _request(4, kv_transfer_params={"_p_side_truncated": True}),
]


def _key(req: int, group: int, chunk: int) -> bytes:
    last = (chunk + 1) * GROUPS[group][1] // HASH - 1
    return make_offload_key(REQUESTS[req].block_hashes[last], group)


def _partial_key(req: int, group: int, units: int) -> bytes:
    return make_offload_key(REQUESTS[req].block_hashes[units - 1], group)


def _chunks(group: int) -> int:
    return 256 // GROUPS[group][1]


# Few requests, chunks and tails, so that calls and events meet the same keys often.
RECORDS = {
    "store": "record_store",
    "lookup": "record_lookup",
    "pstore": "record_partial_store",
    "plookup": "record_partial_lookup",
}
req_ = st.sampled_from([0, 0, 1, 1, 2, 3, 4])
group_ = st.sampled_from(sorted(GROUPS))
chunk_ = st.sampled_from([0, 0, 1, 3])
units_ = st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16])  # a tail's end, in hashes
# Most of an event's keys are keys already recorded or stored: the n-th latest of them.
seen_ = st.tuples(st.just("seen"), st.sampled_from([0, 0, 1, 2, 5]), st.just(0), st.just(0))
key_ = st.one_of(
    seen_, seen_, seen_, seen_,
    st.tuples(st.just("chunk"), req_, group_, chunk_),
    st.tuples(st.just("partial"), req_, group_, units_),
)  # fmt: skip
record_ = st.one_of(
    st.tuples(st.sampled_from(["store", "store", "lookup"]), req_, group_, chunk_),
    st.tuples(st.sampled_from(["pstore", "plookup"]), req_, group_, units_),
)
context_ = st.one_of(
    st.tuples(st.just("new_request"), req_),
    # a request's context, its chunk's end recorded, and a store carrying it
    st.tuples(
        st.just("described"), req_, group_, chunk_, st.sampled_from([0, 0, 1, 2]), st.booleans()
    ),
    st.tuples(st.just("position"), req_, group_, chunk_, st.sampled_from([0, 0, 0, HASH])),
)
event_ = st.tuples(
    st.just("event"),
    st.booleans(),  # removed
    st.lists(key_, min_size=1, max_size=3),
    st.sampled_from([0, 0, 1, 2]),  # the tier
    st.booleans(),  # removal expected
    st.integers(0, 5),  # metadata only when 0
    st.one_of(st.none(), req_),  # the request context a store carries
)
op_ = st.one_of(record_, record_, context_, context_, event_, event_, event_,
                st.tuples(st.just("reset")))  # fmt: skip
scenario_ = st.tuples(
    st.sampled_from([True, True, True, False]),  # the tracker on
    st.sampled_from([0, 0, 2]),  # look-ahead tokens (0.34)
    st.lists(op_, min_size=20, max_size=80),
)


@dataclass
class Pair:
    """The same calls made to vLLM's tracker and to kvledger's."""

    version: str
    events: ModuleType  # vLLM's tracker module
    base: ModuleType  # vLLM's keys, contexts and raw events
    theirs: Any
    ours: OffloadingEventsTracker
    their_configs: dict[int, Any] = field(default_factory=dict)
    our_configs: dict[int, GroupOffloadConfig] = field(default_factory=dict)
    their_contexts: dict[int, Any] = field(default_factory=dict)
    our_contexts: dict[int, RequestContext] = field(default_factory=dict)
    seen: list[bytes] = field(default_factory=list)  # keys recorded or stored, latest last

    @classmethod
    def new(cls, version: str, modules: tuple[ModuleType, ModuleType], on: bool, ahead: int):
        events, base = modules
        config = base.OffloadingKVEventsConfig(enable_kv_cache_events=on,
                                               self_describing_kv_events=True)  # fmt: skip
        specs = {g: OffloadingEventGroupSpec(kind, None) for g, (_, _, kind, _) in GROUPS.items()}
        their_specs = {g: events.OffloadingEventGroupSpec(*s) for g, s in specs.items()}
        newer = version != "0.33.0"
        theirs = (
            events.OffloadingEventsTracker(config, their_specs, num_hash_lookahead_tokens=ahead)
            if newer
            else events.OffloadingEventsTracker(config, their_specs)
        )
        ours = OffloadingEventsTracker(on, specs, vllm_version=version,
                                       num_hash_lookahead_tokens=ahead if newer else 0)  # fmt: skip
        pair = cls(version, events, base, theirs, ours)
        from vllm.v1.kv_cache_interface import MambaSpec  # the stand-in the tracker tests

        for g, (block, chunk, kind, window) in GROUPS.items():
            mine = GroupOffloadConfig(g, block, chunk, chunk // HASH, specs[g], window)
            pair.our_configs[g] = mine
            pair.their_configs[g] = SimpleNamespace(
                **{**mine._asdict(), "kv_event_group_spec": their_specs[g]},
                kv_cache_spec=MambaSpec() if kind == "mamba" else object(),
            )
        return pair

    def both(self, theirs: Any, ours: Any) -> tuple[Any, Any]:
        """Each side's answer, or that it refused (vLLM asserts, kvledger raises
        TrackerInputError: the same refusal)."""
        results: list[Any] = []
        for call in (theirs, ours):
            try:
                results.append(call())
            except (AssertionError, ValueError, IndexError):
                results.append("refused")
        return results[0], results[1]

    def run(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind in ("store", "lookup", "pstore", "plookup"):
            _, r, g, n = op
            if kind in ("store", "lookup"):
                if n >= _chunks(g):
                    return
                key = _key(r, g, n)
            else:
                key = _partial_key(r, g, n)
            name = RECORDS[kind]
            mine, theirs = self.our_configs[g], self.their_configs[g]
            n_arg = n if kind in ("store", "lookup") else n * HASH
            self.seen.append(key)
            a, b = self.both(
                lambda: getattr(self.theirs, name)(REQUESTS[r], theirs, n_arg, key),
                lambda: getattr(self.ours, name)(REQUESTS[r], mine, n_arg, key),
            )
            assert a == b, (op, a, b)
        elif kind == "new_request":
            # 0.33's tracker has no request contexts: under its rules ours ignores them
            r = op[1]
            self.our_contexts[r] = RequestContext()
            self.ours.on_new_request(self.our_contexts[r], REQUESTS[r], self.our_configs.values())
            if self.version != "0.33.0":
                self.their_contexts[r] = self.base.ReqContext(req_id=str(r))
                self.theirs.on_new_request(self.their_contexts[r], REQUESTS[r],
                                           tuple(self.their_configs.values()))  # fmt: skip
        elif kind == "position":
            _, r, g, c, offset = op
            if r in self.our_contexts and c < _chunks(g):
                end = (c + 1) * GROUPS[g][1] - offset
                self.our_contexts[r].set_offload_key_position(_key(r, g, c), end)
                if r in self.their_contexts:
                    self.their_contexts[r].set_offload_key_position(_key(r, g, c), end)
        elif kind == "described":
            _, r, g, c, tier, expected = op
            if r not in self.our_contexts:
                self.run(("new_request", r))
            self.run(("position", r, g, c, 0))
            self.event(False, [("chunk", r, g, c)], tier, expected, 1, r)
        elif kind == "event":
            self.event(*op[1:])
        else:
            self.theirs.reset()
            self.ours.reset()

    def event(self, removed: bool, keys: list[tuple[Any, ...]], tier: int, expected: bool,
              meta: int, context: int | None) -> None:  # fmt: skip
        picked = []
        for what, r, g, n in keys:
            if what == "seen":
                if self.seen:
                    picked.append(self.seen[-1 - r % len(self.seen)])
            elif what == "chunk":
                picked.append(_key(r, g, n % _chunks(g)))
            else:
                picked.append(_partial_key(r, g, n))
        if not picked:
            return
        if not removed:
            self.seen.extend(picked)
        medium, ownership, locality = TIERS[tier]
        common = {
            "keys": picked,
            "removed": removed,
            "ownership": ownership,
            "removal_expected": expected and not removed,
            "metadata_only": removed and meta == 0,
        }
        their_kw: dict[str, Any] = {}
        our_kw: dict[str, Any] = {}
        if not removed and context in self.our_contexts:
            our_kw["req_context"] = self.our_contexts[context]
            if context in self.their_contexts:
                their_kw["req_context"] = self.their_contexts[context]
        base = self.base
        their_event = base.OffloadingEvent(
            medium=base.Medium[medium], locality=locality and base.Locality[locality],
            **common, **their_kw,
        )  # fmt: skip
        our_event = OffloadingEvent(
            medium=Medium[medium], locality=locality and Locality[locality], **common, **our_kw
        )  # fmt: skip
        theirs = [_plain(e) for e in self.theirs.take_events([their_event])]
        ours = [_plain(e) for e in self.ours.take_events([our_event])]
        assert theirs == ours

    def kept(self) -> tuple[dict[bytes, set[Any]], dict[bytes, set[Any]]]:
        """The offload keys each side keeps a payload for, with their residencies (tier,
        owner): a set in vLLM 0.33, a bitmask of its residency bits in 0.34."""
        theirs = {}
        for key, meta in self.theirs._pending_event_metadata.items():
            held = meta.active_residencies
            if isinstance(held, int):
                bits = self.theirs._residency_bits.items()
                held = {tier for tier, bit in bits if held & bit}
            theirs[key] = {(m.value, owner) for m, owner in held}
        ours = {
            key: {(m.value, owner) for m, owner in self.ours.residencies(key)}
            for key in self.ours._payloads
        }
        return theirs, ours


_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "lookahead_token_ids",
)  # fmt: skip


def _plain(event: Any) -> tuple[str, dict[str, Any]]:
    """An event as its class name and its vLLM fields, sequences as tuples."""

    def tup(v: Any) -> Any:
        return tuple(tup(x) for x in v) if isinstance(v, (list, tuple)) else v

    return type(event).__name__, {f: tup(getattr(event, f)) for f in _FIELDS if hasattr(event, f)}


@pytest.fixture(scope="module", params=VERSIONS)
def vllm(request: pytest.FixtureRequest) -> Iterator[tuple[str, tuple[ModuleType, ModuleType]]]:
    with vllm_tracker(request.param) as modules:
        yield request.param, modules


def _run(version: str, modules: tuple[ModuleType, ModuleType], scenario: Any) -> Pair:
    on, ahead, ops = scenario
    pair = Pair.new(version, modules, on, ahead)
    for op in ops:
        pair.run(op)
        theirs, ours = pair.kept()
        assert theirs == ours, op
    return pair


SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=400, deadline=None, suppress_health_check=SLOW)
@given(scenario=scenario_)
def test_the_same_events_as_vllms_own_tracker(
    vllm: tuple[str, tuple[ModuleType, ModuleType]], scenario: Any
) -> None:
    _run(*vllm, scenario)


def test_the_scenarios_reach_every_kind_of_event(
    vllm: tuple[str, tuple[ModuleType, ModuleType]],
) -> None:
    """The comparison is not vacuous: described stores (from a record and, under 0.34, from a
    request context), placeholders, checkpoints, look-ahead and expanded removals all occur."""
    version, modules = vllm
    store_all = [("store", 0, g, c) for g in GROUPS for c in range(_chunks(g))]
    ops = [
        *store_all,
        ("new_request", 1),
        ("position", 1, 1, 5, 0),
        ("position", 1, 0, 3, HASH),  # not on a chunk's end: a placeholder
        ("event", False, [("chunk", 0, g, c) for g in GROUPS for c in (0, 1)], 1, True, 1, None),
        ("event", False, [("chunk", 1, 1, 5), ("chunk", 1, 0, 3)], 0, True, 1, 1),
        ("event", True, [("chunk", 0, 0, 0), ("chunk", 1, 1, 5)], 1, False, 1, None),
    ]
    pair = _run(version, modules, (True, 2, ops))
    assert pair.ours.tracked_keys() > 0
    # The same batch again, on a fresh pair, kept for what it emitted.
    pair = Pair.new(version, modules, True, 2 if version != "0.33.0" else 0)
    for op in ops[:-3]:
        pair.run(op)
    emitted = pair.ours.take_events([OffloadingEvent(
        [_key(0, g, 0) for g in GROUPS] + [_key(1, 1, 5)], Medium.CPU, removed=False,
        removal_expected=True, req_context=pair.our_contexts.get(1),
    )])  # fmt: skip
    by_group = {e.group_idx: e for e in emitted[:4]}
    assert by_group[0].token_ids and by_group[1].token_ids
    assert by_group[2].block_size == 0  # the window's placeholder
    if version == "0.33.0":
        assert by_group[3].block_size == 0 and len(emitted) == 5
        assert emitted[4].block_size == 0  # no request context before 0.34
    else:
        assert len(by_group[3].block_hashes) == 1 and by_group[3].token_ids == ()
        assert by_group[0].lookahead_token_ids is not None
        assert emitted[4].token_ids == tuple(REQUESTS[1].all_token_ids[160:192])


def test_vllm_034s_tracker_batches_are_read_and_valid() -> None:
    """What vLLM 0.34's own tracker emits (state checkpoints of a recurrent group, whole and
    partial, full-attention chunks with look-ahead tokens, placeholders, expanded removals),
    in a batch its own event classes encode, is what the relay reads and the consumer's
    checks accept against the groups' announced specs."""
    import msgspec

    from kvledger.consumer.core.model import HeldSpec
    from kvledger.consumer.core.validate import check_removed, check_stored
    from kvledger.producer.relay.wire import decode_batch
    from kvledger.producer.vllm import fit_to_spec
    from kvledger.schemas.events import BlockStored, GroupSpec

    with vllm_tracker("0.34.0") as modules:
        pair = Pair.new("0.34.0", modules, True, 2)
        tracker = pair.theirs
        for g in GROUPS:
            for c in range(_chunks(g)):
                tracker.record_store(REQUESTS[0], pair.their_configs[g], c, _key(0, g, c))
        tracker.record_partial_store(REQUESTS[0], pair.their_configs[3], 3 * HASH,
                                     _partial_key(0, 3, 3))  # fmt: skip
        keys = [_key(0, g, c) for g in GROUPS for c in range(_chunks(g))]
        base = pair.base
        raw = [
            base.OffloadingEvent([*keys, _partial_key(0, 3, 3)], base.Medium.CPU, False),
            base.OffloadingEvent(keys[:3], base.Medium.CPU, True),
        ]
        kv = __import__("vllm.distributed.kv_events", fromlist=["KVEventBatch"])
        batch = kv.KVEventBatch(ts=1_764_000_000.5, events=list(tracker.take_events(raw)))
        payload = msgspec.msgpack.encode(batch)
    held = {
        g: HeldSpec(
            GroupSpec("m", g, kind, block, HASH, sliding_window=128 if window else None),
            "announced",
        )
        for g, (block, _, kind, window) in GROUPS.items()
    }
    events = decode_batch(payload).events
    checkpoints = partial = 0
    for read in events:
        if isinstance(read, BlockStored):
            event = fit_to_spec(read, held[read.group_idx].spec)
            assert isinstance(event, BlockStored)
            assert check_stored(event, held[event.group_idx]) is None, event
            checkpoints += event.is_state_checkpoint
            partial += event.is_state_checkpoint and event.partial
        else:
            assert check_removed(read, held[read.group_idx]) is None, read
    assert checkpoints == _chunks(3) + 1 and partial == 1
    assert any(isinstance(e, BlockStored) and e.lookahead_token_ids for e in events)
