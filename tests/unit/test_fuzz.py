"""Arbitrary input to decode + validate: only the typed rejection may come out."""

from __future__ import annotations

import contextlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger._core import BlockRows
from kvledger.consumer.core.model import BlockRow, HeldSpec
from kvledger.consumer.core.validate import (
    check_announcement,
    check_cleared,
    check_removed,
    check_stored,
)
from kvledger.schemas.codec import SINGLE_OBJECT_MAGIC, Codec
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Envelope, GroupSpec
from tests.helpers.reference_rows import conflicts

CODEC = Codec()
HEADER = SINGLE_OBJECT_MAGIC + struct.pack("<Q", CODEC.fingerprint)
ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
small = st.integers(min_value=-5, max_value=300)
hashes = st.lists(st.binary(max_size=70), max_size=6).map(tuple)
text = st.one_of(st.none(), st.sampled_from(["CPU", "GPU", "STORAGE", "", "TAPE"]))
specs = st.one_of(
    st.none(),
    st.builds(
        HeldSpec,
        st.builds(
            GroupSpec,
            st.just("m"),
            st.just(0),
            st.sampled_from(["full_attention", "sliding_window", "mamba", "unknown"]),
            small,
            small,
            st.one_of(st.none(), small),
        ),
        st.sampled_from(["declared", "announced"]),
    ),
)
stored = st.builds(
    BlockStored,
    hashes,
    st.one_of(st.none(), st.binary(max_size=40)),
    st.lists(ints, max_size=80).map(tuple),
    small,
    st.one_of(st.none(), ints),
    text,
    st.one_of(st.none(), st.text(max_size=5)),
    st.none(),
    st.one_of(st.none(), small),
    st.one_of(st.none(), st.text(max_size=12)),
    st.one_of(st.none(), small),
    st.one_of(st.none(), st.text(max_size=6)),
    st.one_of(st.none(), st.text(max_size=6)),
    st.one_of(st.none(), st.integers(min_value=-(2**40), max_value=2**40)),
    st.booleans(),
)


def _validate(event: object, spec: HeldSpec | None) -> None:
    if isinstance(event, BlockStored):
        if check_stored(event, spec) is None:  # stored twice: its rows meet themselves
            rows = BlockRows({})
            for _ in range(2):
                rows.store("m", 0, event.block_hashes, event.token_ids, event.block_size,
                           event.token_start, event.parent_block_hash, event.partial,
                           event.lora_name, event.extra_keys, 0)  # fmt: skip
            rows.copy_binary()
    elif isinstance(event, BlockRemoved):
        check_removed(event, spec)
    elif isinstance(event, AllBlocksCleared):
        check_cleared(event)
    elif isinstance(event, GroupSpec):
        check_announcement(event, spec)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), specs)
def test_arbitrary_bytes_decode_or_reject(data: bytes, spec: HeldSpec | None) -> None:
    for candidate in (data, HEADER + data):
        try:
            envelope = CODEC.decode(candidate)
        except DecodeError as exc:
            assert exc.reason in {"undecodable", "unknown_schema"}
            continue
        _validate(envelope.event, spec)


@settings(max_examples=400, deadline=None)
@given(stored, specs)
def test_arbitrary_events_validate_without_exceptions(
    event: BlockStored, spec: HeldSpec | None
) -> None:
    _validate(event, spec)
    try:
        data = CODEC.encode(Envelope("s", "m", 0, 1, 0, 0, event))
    except (ValueError, TypeError, OverflowError):
        return  # out of the schema's range: a producer error, never on the wire
    # Any bit flip of a valid message decodes to something valid or a typed rejection.
    for i in range(10, len(data), max(1, len(data) // 16)):
        flipped = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]
        with contextlib.suppress(DecodeError):
            _validate(CODEC.decode(flipped).event, spec)


def test_conflicts_granularity_rules() -> None:
    full = BlockRow(b"p", 64, tuple(range(64, 96)), 32, False)

    def against_full(row: BlockRow) -> str | None:
        """Why the compiled core refuses ``row`` for the hash it knows as ``full``."""
        rows = BlockRows({("m", 0, b"h"): full})
        parent, start, tokens, size, partial = row
        return rows.store("m", 0, (b"h",), tokens, size, start, parent, partial, None, None, 0)

    tail = BlockRow(b"q", 80, tuple(range(80, 96)), 16, True)
    assert against_full(tail) is None  # the tail is the full block's suffix
    shifted = BlockRow(b"q", 96, tuple(range(96, 112)), 16, True)
    assert against_full(shifted) == "same hash announced ending at a different position: hash 68"
    other = BlockRow(b"p", 64, tuple(range(1, 33)), 32, False)
    assert against_full(other) == "same hash announced with different tokens: hash 68"
    reparented = BlockRow(b"x", 64, tuple(range(64, 96)), 32, False)
    assert against_full(reparented) == "same hash announced with a different parent: hash 68"
    for row in (tail, shifted, other, reparented):  # the Python rules say the same
        assert (conflicts(full, row) is None) == (against_full(row) is None)
