"""Invariants of the tracker over random sequences of records and manager events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.producer.tracker import (
    Medium,
    OffloadingEvent,
    OffloadingEventsTracker,
    make_offload_key,
)
from kvledger.schemas.events import BlockStored
from tests.unit.test_tracker import FULL, SLIDING, cfg, request

GROUPS = {
    0: cfg(16, 64, 4, group_idx=0),  # hash = block
    1: cfg(32, 64, 8, group_idx=1),  # 8-token hashes, 32-token blocks
    2: cfg(16, 64, 4, group_idx=2, spec=SLIDING, window=2),
}
TIERS = [(Medium.CPU, None), (Medium.STORAGE, "disk"), (Medium.STORAGE, "remote")]
REQS = [request(256, 4, salt=s, base=100 * s) for s in range(3)]

op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("lookup"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("pstore"), st.integers(0, 2), st.integers(0, 2), st.integers(1, 63)),
    st.tuples(st.just("plookup"), st.integers(0, 2), st.integers(0, 2), st.integers(1, 63)),
    st.tuples(
        st.just("event"),
        st.integers(0, 2),
        st.integers(0, 2),
        st.tuples(
            st.integers(0, 3), st.integers(0, 2), st.booleans(), st.booleans(), st.booleans()
        ),
    ),
)


def _key_for(req_idx: int, group_idx: int, unit: int, partial: bool) -> bytes:
    config = GROUPS[group_idx]
    req = REQS[req_idx]
    if partial:
        boundary = unit * 4
        return make_offload_key(req.block_hashes[boundary // 4 - 1] or b"", config.group_idx)
    tokens_per_hash = config.tokens_per_chunk // config.hashes_per_chunk
    last = (unit + 1) * config.tokens_per_chunk // tokens_per_hash - 1
    return make_offload_key(REQS[req_idx].block_hashes[last] or b"", config.group_idx)


def _check(events: list[object]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored) and not ev.is_placeholder:
            assert ev.kv_cache_spec_kind == FULL.kv_cache_spec_kind
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            assert ev.token_start is not None and ev.token_start >= 0


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40))
def test_no_leak_and_consistent_payloads(ops: list[tuple[object, ...]]) -> None:
    tracker = OffloadingEventsTracker(
        group_specs={i: c.kv_event_group_spec for i, c in GROUPS.items()}
    )
    keys: set[bytes] = set()
    for kind, r, g, arg in ops:
        assert isinstance(r, int) and isinstance(g, int)
        config, req = GROUPS[g], REQS[r]
        if kind in ("store", "lookup"):
            assert isinstance(arg, int)
            key = _key_for(r, g, arg, partial=False)
            getattr(tracker, f"record_{kind}")(req, config, arg, key)
            keys.add(key)
        elif kind in ("pstore", "plookup"):
            assert isinstance(arg, int)
            boundary = arg * 4
            tokens_per_hash = config.tokens_per_chunk // config.hashes_per_chunk
            if boundary % tokens_per_hash:
                continue
            key = _key_for(r, g, arg, partial=True)
            method = "record_partial_store" if kind == "pstore" else "record_partial_lookup"
            getattr(tracker, method)(req, config, boundary, key)
            keys.add(key)
        else:
            assert isinstance(arg, tuple)
            unit, tier, removed, expected, meta_only = arg
            key = _key_for(r, g, unit, partial=False)
            medium, ownership = TIERS[tier]
            event = OffloadingEvent(
                [key],
                medium,
                removed=removed,
                ownership=ownership,
                removal_expected=expected and not removed,
                metadata_only=meta_only and removed,
            )
            _check(tracker.take_events([event]))
            keys.add(key)
    # Remove every residency still recorded: nothing may stay behind.
    for key in keys:
        for medium, ownership in tracker.residencies(key):
            _check(tracker.take_events([OffloadingEvent([key], medium, True, ownership=ownership)]))
    assert tracker.tracked_keys() == 0
