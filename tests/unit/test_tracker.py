"""The tracker against vLLM 0.33.0's rules, with concrete numbers (no services)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvledger.producer.tracker import (
    GroupOffloadConfig,
    Locality,
    Medium,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    TrackerInputError,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
    resolve_block_hashes,
)
from kvledger.schemas.events import BlockRemoved, BlockStored

FULL = OffloadingEventGroupSpec("full_attention", None)
SLIDING = OffloadingEventGroupSpec("sliding_window", 128)


@dataclass
class Lora:
    adapter_id: int
    name: str


@dataclass
class Req:
    block_hashes: list[bytes | None]
    all_token_ids: list[int]
    lora_request: Lora | None = None


@dataclass
class Env:
    tracker: OffloadingEventsTracker = field(default_factory=OffloadingEventsTracker)


def raw(i: int, salt: int = 0) -> bytes:
    return bytes([salt]) + i.to_bytes(7, "big")


def request(num_tokens: int, tokens_per_hash: int, salt: int = 0, base: int = 1000) -> Req:
    return Req(
        block_hashes=[raw(i, salt) for i in range(num_tokens // tokens_per_hash)],
        all_token_ids=list(range(base, base + num_tokens)),
    )


def cfg(
    tokens_per_block: int,
    tokens_per_chunk: int,
    hashes_per_chunk: int,
    group_idx: int = 0,
    spec: OffloadingEventGroupSpec = FULL,
    window: int | None = None,
) -> GroupOffloadConfig:
    return GroupOffloadConfig(
        group_idx, tokens_per_block, tokens_per_chunk, hashes_per_chunk, spec, window
    )


def chunk_key(req: Req, config: GroupOffloadConfig, chunk_idx: int) -> bytes:
    last = (chunk_idx + 1) * config.hashes_per_chunk - 1
    h = req.block_hashes[last]
    assert h is not None
    return make_offload_key(h, config.group_idx)


def store(key: bytes, medium: Medium = Medium.CPU, **kw: object) -> OffloadingEvent:
    return OffloadingEvent([key], medium, removed=False, **kw)  # type: ignore[arg-type]


def remove(keys: list[bytes], medium: Medium = Medium.CPU, **kw: object) -> OffloadingEvent:
    return OffloadingEvent(keys, medium, removed=True, **kw)  # type: ignore[arg-type]


def only(events: list[BlockStored | BlockRemoved]) -> BlockStored | BlockRemoved:
    assert len(events) == 1, events
    return events[0]


# ---------------------------------------------------------------- keys and resolution
def test_offload_key_round_trip() -> None:
    key = make_offload_key(b"\x01\x02\x03", 7)
    assert key == b"\x01\x02\x03\x00\x00\x00\x07"
    assert offload_key_hash(key) == b"\x01\x02\x03"
    assert offload_key_group(key) == 7


def test_resolve_keeps_last_raw_hash_of_each_block() -> None:
    hashes = [raw(i) for i in range(128)]
    # 4-token hashes, 256-token blocks: 64 raw hashes per block.
    assert resolve_block_hashes(hashes, 4, 256) == [raw(63), raw(127)]
    assert resolve_block_hashes(hashes[:8], 16, 16) == hashes[:8]
    with pytest.raises(TrackerInputError):
        resolve_block_hashes(hashes, 4, 10)


# ---------------------------------------------------------------- full chunks
def test_full_chunk_same_granularity() -> None:
    t = OffloadingEventsTracker()
    req = request(256, 16)
    c = cfg(tokens_per_block=16, tokens_per_chunk=64, hashes_per_chunk=4)
    key = chunk_key(req, c, 1)
    t.record_store(req, c, 1, key)
    ev = only(t.take_events([store(key)]))
    assert ev == BlockStored(
        block_hashes=(raw(4), raw(5), raw(6), raw(7)),
        parent_block_hash=raw(3),
        token_ids=tuple(range(1064, 1128)),
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        token_start=64,
        partial=False,
    )


def test_first_chunk_has_no_parent() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash is None
    assert ev.token_start == 0


@pytest.mark.parametrize(
    ("blocks_per_chunk", "chunk_idx", "hashes", "parent"),
    [
        (1, 0, (63,), None),
        (1, 1, (127,), 63),
        (1, 3, (255,), 191),
        (2, 0, (63, 127), None),
        (2, 1, (191, 255), 127),
    ],
)
def test_hash_granularity_resolution(
    blocks_per_chunk: int, chunk_idx: int, hashes: tuple[int, ...], parent: int | None
) -> None:
    # 4-token hashes, 256-token blocks, 1 or 2 blocks per chunk.
    t = OffloadingEventsTracker()
    req = request(1024, 4)
    tokens_per_chunk = 256 * blocks_per_chunk
    c = cfg(256, tokens_per_chunk, tokens_per_chunk // 4)
    key = chunk_key(req, c, chunk_idx)
    t.record_store(req, c, chunk_idx, key)
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == tuple(raw(i) for i in hashes)
    assert ev.parent_block_hash == (raw(parent) if parent is not None else None)
    assert ev.block_size == 256
    assert len(ev.token_ids) == tokens_per_chunk == len(ev.block_hashes) * ev.block_size
    assert ev.token_start == chunk_idx * tokens_per_chunk
    assert ev.token_ids[0] == 1000 + chunk_idx * tokens_per_chunk


def test_lora_locality_and_ownership_are_forwarded() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    req.lora_request = Lora(3, "sql-adapter")
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    ev = only(
        t.take_events([store(key, Medium.STORAGE, locality=Locality.REMOTE, ownership="s3-tier")])
    )
    assert isinstance(ev, BlockStored)
    assert (ev.lora_id, ev.lora_name) == (3, "sql-adapter")
    assert (ev.medium, ev.locality, ev.ownership) == ("STORAGE", "REMOTE", "s3-tier")


# ---------------------------------------------------------------- partial tails
@pytest.mark.parametrize(
    ("boundary", "first", "last", "start", "parent"),
    [
        (24, 4, 6, 16, 3),  # inside the second block
        (32, 4, 8, 16, 3),  # exactly on a block edge: still the second block
        (4, 0, 1, 0, None),  # the very first hash
        (36, 8, 9, 32, 7),
    ],
)
def test_partial_tail(boundary: int, first: int, last: int, start: int, parent: int | None) -> None:
    # 4-token hashes, 16-token blocks, one block per chunk.
    t = OffloadingEventsTracker()
    req = request(64, 4)
    c = cfg(16, 16, 4)
    key = make_offload_key(raw(last - 1), 0)
    t.record_partial_store(req, c, boundary, key)
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert ev.partial is True
    assert ev.block_size == 4
    assert ev.block_hashes == tuple(raw(i) for i in range(first, last))
    assert ev.token_ids == tuple(range(1000 + start, 1000 + boundary))
    assert ev.token_start == start
    assert ev.parent_block_hash == (raw(parent) if parent is not None else None)
    assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size


def test_partial_lookup_backfills_but_never_overwrites() -> None:
    t = OffloadingEventsTracker()
    stored = request(64, 4, base=1000)
    other = request(64, 4, base=5000)
    c = cfg(16, 16, 4)
    key = make_offload_key(raw(5), 0)
    t.record_partial_store(stored, c, 24, key)
    t.record_partial_lookup(other, c, 24, key)
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert ev.token_ids[0] == 1016
    # Nothing recorded yet: a lookup backfills.
    key2 = make_offload_key(raw(9), 0)
    t.record_partial_lookup(other, c, 40, key2)
    ev2 = only(t.take_events([store(key2)]))
    assert isinstance(ev2, BlockStored)
    assert ev2.token_ids == tuple(range(5032, 5040))


# ---------------------------------------------------------------- lookups
def test_lookup_does_not_overwrite_a_store() -> None:
    t = OffloadingEventsTracker()
    stored = request(64, 16, base=1000)
    looked_up = request(64, 16, base=9000)
    c = cfg(16, 64, 4)
    key = chunk_key(stored, c, 0)
    t.record_store(stored, c, 0, key)
    t.record_lookup(looked_up, c, 0, key)
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert ev.token_ids[:2] == (1000, 1001)


def test_lookup_registers_primary_residency() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_lookup(req, c, 0, key)
    assert t.residencies(key) == {(Medium.CPU, None)}
    # A lookup after a metadata-only release brings the primary residency back.
    t.take_events([remove([key], metadata_only=True)])
    assert t.tracked_keys() == 0
    t.record_lookup(req, c, 0, key)
    t.take_events([store(key, Medium.STORAGE, ownership="disk", removal_expected=True)])
    t.take_events([remove([key], Medium.STORAGE, ownership="disk")])
    assert t.residencies(key) == {(Medium.CPU, None)}


# ---------------------------------------------------------------- placeholders
def test_sliding_window_group_records_nothing_and_emits_placeholders() -> None:
    t = OffloadingEventsTracker(group_specs={1: SLIDING})
    req = request(64, 16)
    c = cfg(16, 64, 4, group_idx=1, spec=SLIDING, window=2)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    t.record_lookup(req, c, 0, key)
    t.record_partial_store(req, c, 16, key)
    assert t.tracked_keys() == 0
    ev = only(t.take_events([store(key, ownership=None)]))
    assert ev == BlockStored(
        block_hashes=(raw(3),),
        parent_block_hash=None,
        token_ids=(),
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
    )
    assert isinstance(ev, BlockStored) and ev.is_placeholder
    rem = only(t.take_events([remove([key])]))
    assert rem == BlockRemoved((raw(3),), "CPU", group_idx=1)


def test_disabled_tracker_emits_placeholders_without_group_kind() -> None:
    t = OffloadingEventsTracker(enabled=False, group_specs={0: FULL})
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    t.record_partial_store(req, c, 16, key)
    assert t.tracked_keys() == 0
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert ev.is_placeholder
    assert (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == (None, None)


def test_unknown_key_store_gets_placeholder_with_group_spec() -> None:
    t = OffloadingEventsTracker(group_specs={2: FULL})
    key = make_offload_key(b"\xaa" * 8, 2)
    ev = only(t.take_events([store(key, Medium.STORAGE, ownership="x")]))
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (b"\xaa" * 8,)
    assert (ev.group_idx, ev.kv_cache_spec_kind, ev.block_size) == (2, "full_attention", 0)
    assert ev.token_start is None


# ---------------------------------------------------------------- residencies
def test_restore_merges_residencies_via_record_store() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    t.take_events([store(key), store(key, Medium.STORAGE, ownership="disk", removal_expected=True)])
    t.record_store(req, c, 0, key)  # re-store: the STORAGE residency is merged in
    assert t.residencies(key) == {(Medium.CPU, None), (Medium.STORAGE, "disk")}
    # The CPU copy goes; the STORAGE copy keeps the payload alive.
    ev = only(t.take_events([remove([key])]))
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == (raw(0), raw(1), raw(2), raw(3))
    assert t.tracked_keys() == 1
    ev = only(t.take_events([remove([key], Medium.STORAGE, ownership="disk")]))
    assert isinstance(ev, BlockRemoved) and ev.ownership == "disk"
    assert t.tracked_keys() == 0


def test_restore_merges_residencies_via_record_partial_store() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 4)
    c = cfg(16, 16, 4)
    key = make_offload_key(raw(5), 0)
    t.record_partial_store(req, c, 24, key)
    t.take_events([store(key, Medium.STORAGE, ownership="disk", removal_expected=True)])
    t.record_partial_store(req, c, 24, key)
    assert t.residencies(key) == {(Medium.CPU, None), (Medium.STORAGE, "disk")}


def test_store_without_removal_expected_adds_no_residency() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    t.take_events([store(key, Medium.STORAGE, ownership="disk")])
    assert t.residencies(key) == {(Medium.CPU, None)}
    t.take_events([remove([key])])
    assert t.tracked_keys() == 0


def test_primary_removal_before_secondary_store_in_one_batch() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    out = t.take_events(
        [remove([key]), store(key, Medium.STORAGE, ownership="disk", removal_expected=True)]
    )
    assert [type(e) for e in out] == [BlockRemoved, BlockStored]
    second = out[1]
    assert isinstance(second, BlockStored) and not second.is_placeholder
    assert t.residencies(key) == {(Medium.STORAGE, "disk")}


def test_metadata_only_removal_emits_nothing() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    assert t.take_events([remove([key], metadata_only=True)]) == []
    assert t.tracked_keys() == 0
    # Unknown keys too: silent.
    assert t.take_events([remove([make_offload_key(b"zz", 0)], metadata_only=True)]) == []


def test_removals_grouped_per_group_with_all_chunk_hashes() -> None:
    t = OffloadingEventsTracker()
    req = request(256, 16)
    g0 = cfg(16, 64, 4, group_idx=0)
    g1 = cfg(32, 64, 4, group_idx=1)
    k00, k01 = chunk_key(req, g0, 0), chunk_key(req, g0, 1)
    k10 = chunk_key(req, g1, 0)
    t.record_store(req, g0, 0, k00)
    t.record_store(req, g0, 1, k01)
    t.record_store(req, g1, 0, k10)
    unknown = make_offload_key(b"\x99" * 8, 1)
    out = t.take_events([remove([k00, k10, k01, unknown], locality=Locality.LOCAL)])
    assert out == [
        BlockRemoved(tuple(raw(i) for i in range(8)), "CPU", 0, "LOCAL", None),
        BlockRemoved((raw(1), raw(3), b"\x99" * 8), "CPU", 1, "LOCAL", None),
    ]


def test_reset_drops_payloads_but_keeps_group_specs() -> None:
    t = OffloadingEventsTracker(group_specs={0: FULL})
    req = request(64, 16)
    c = cfg(16, 64, 4)
    key = chunk_key(req, c, 0)
    t.record_store(req, c, 0, key)
    t.reset()
    assert t.tracked_keys() == 0
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert ev.is_placeholder and ev.kv_cache_spec_kind == "full_attention"


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t, r, c: t.record_partial_store(r, c, 22, b"k" * 12), "hash edge"),
        (lambda t, r, c: t.record_partial_store(r, c, 0, b"k" * 12), "positive"),
        (lambda t, r, c: t.record_partial_store(r, c, 80, b"k" * 12), "needs 20 hashes"),
        (lambda t, r, c: t.record_store(r, c, 4, b"k" * 12), "request has 16"),
        (lambda t, r, c: t.record_lookup(r, c, -1, b"k" * 12), "negative"),
    ],
)
def test_invalid_input_raises_value_error(call, message: str) -> None:  # type: ignore[no-untyped-def]
    t = OffloadingEventsTracker()
    req = request(64, 4)
    c = cfg(16, 16, 4)
    with pytest.raises(TrackerInputError, match=message) as info:
        call(t, req, c)
    assert isinstance(info.value, ValueError)


def test_missing_hash_raises() -> None:
    t = OffloadingEventsTracker()
    req = request(64, 16)
    req.block_hashes[2] = None
    c = cfg(16, 64, 4)
    with pytest.raises(TrackerInputError, match="missing"):
        t.record_store(req, c, 0, b"k" * 12)


def test_a_placeholder_is_said_once_and_not_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """`simulate` printed two warnings on every run about what they called expected, then
    two INFO lines: the happy path now says it at DEBUG, once."""
    import logging

    from kvledger.producer import tracker as tracker_module

    tracker_module._warned.clear()
    with caplog.at_level(logging.DEBUG, logger="kvledger.producer.tracker"):
        for _ in range(2):
            tracker_module._warn_once("store", "no payload: a placeholder (expected)")
    said = [r for r in caplog.records if "placeholder" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.DEBUG]


# ---------------------------------------------------------------- vLLM 0.34's rules
MAMBA = OffloadingEventGroupSpec("mamba", None)


def test_034_announces_a_recurrent_chunk_as_its_state_checkpoint() -> None:
    t = OffloadingEventsTracker(vllm_version="0.34.0")
    req = request(256, 16)
    c = cfg(tokens_per_block=32, tokens_per_chunk=128, hashes_per_chunk=8, group_idx=1,
            spec=MAMBA, window=1)  # fmt: skip
    key = chunk_key(req, c, 1)  # raw hashes 8..15, blocks ending at raw 9, 11, 13, 15
    t.record_store(req, c, 1, key)
    ev = only(t.take_events([store(key)]))
    assert ev == BlockStored(
        block_hashes=(raw(15),),  # the state, valid at the chunk's last hash only
        parent_block_hash=raw(13),  # the block before it
        token_ids=(),
        block_size=32,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=1,
        kv_cache_spec_kind="mamba",
        token_start=None,
        partial=False,
    )
    assert isinstance(ev, BlockStored) and ev.is_state_checkpoint and not ev.is_placeholder
    assert only(t.take_events([remove([key])])) == BlockRemoved((raw(15),), "CPU", group_idx=1)
    assert t.tracked_keys() == 0


def test_034_a_recurrent_chunk_of_one_block_keeps_its_parent() -> None:
    t = OffloadingEventsTracker(vllm_version="0.34.1")
    req = request(64, 16)
    c = cfg(64, 64, 4, group_idx=1, spec=MAMBA, window=1)
    key = chunk_key(req, c, 0)
    t.record_lookup(req, c, 0, key)  # a lookup hit records it too
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert (ev.block_hashes, ev.parent_block_hash, ev.block_size) == ((raw(3),), None, 64)


def test_034_a_recurrent_partial_tail_is_a_checkpoint_of_the_hash_size() -> None:
    t = OffloadingEventsTracker(vllm_version="0.34.0")
    req = request(128, 16)
    c = cfg(64, 64, 4, group_idx=1, spec=MAMBA, window=1)
    key = make_offload_key(raw(5), 1)
    t.record_partial_store(req, c, 96, key)  # the chunk from 64, hashes 4 and 5
    ev = only(t.take_events([store(key)]))
    assert isinstance(ev, BlockStored)
    assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.partial) == (
        (raw(5),), raw(4), (), 16, True,
    )  # fmt: skip


def test_033_keeps_placeholders_for_recurrent_groups_and_034_for_windows() -> None:
    req = request(64, 16)
    for version, spec, recorded in (("0.33.0", MAMBA, 0), ("0.34.0", SLIDING, 0),
                                    ("0.34.0", MAMBA, 1), ("0.34.0", FULL, 1)):  # fmt: skip
        t = OffloadingEventsTracker(vllm_version=version)
        c = cfg(16, 64, 4, spec=spec, window=None if spec is FULL else 2)
        t.record_store(req, c, 0, chunk_key(req, c, 0))
        assert t.tracked_keys() == recorded, (version, spec)


@pytest.mark.parametrize("version", ["0.32.0", "0.35.0", "1.0", "latest", ""])
def test_an_engine_version_without_known_rules_is_refused(version: str) -> None:
    with pytest.raises(ValueError, match=r"0\.33 and 0\.34 only"):
        OffloadingEventsTracker(vllm_version=version)
