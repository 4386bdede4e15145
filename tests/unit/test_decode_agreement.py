"""The codec's strict decoding, the compiled core's (rust/src/wire.rs, rust/src/avro.rs),
refuses the bytes its oracle refuses (tests/helpers/avro_strict.py's check, then fastavro):
two consumers of one topic never apply and refuse a message differently. The three inputs
fastavro alone accepted are regression cases, on the current schema (the core decodes) and
on a released one (the core checks, fastavro resolves); mutated valid messages are the
property."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.schemas.codec import Codec, released_schemas
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import BlockRemoved, BlockStored, Envelope, EventsLost
from kvledger.schemas.records import envelope_to_record
from tests.helpers.avro_strict import read_long
from tests.helpers.codecs import OracleCodec, pure_codec

COMPILED = Codec()
if COMPILED._compiled is None and os.environ.get("CI") == "true":
    raise AssertionError("CI requires the compiled decoder")
ORACLE = OracleCodec()
assert ORACLE._core is None

STORED = Envelope(
    "engine-0", "m", 0, 1_764_000_000_000, 7, 1_764_000_000_001,
    BlockStored((b"\x01" * 8, b"\x02" * 8), None, tuple(range(32)), 16, None, "GPU", None,
                group_idx=0),
)  # fmt: skip
REMOVED = Envelope("engine-0", "m", 0, 1, 8, 2, BlockRemoved((b"\x01" * 8,), "CPU"))
LOST = Envelope("engine-0", "m", 0, 1, 8, 2, EventsLost(3, 9, group_idx=0))
HEAD = len(COMPILED.encode(STORED)) - len(COMPILED.encode(STORED)[10:])  # the 10-byte header


def outcome(codec: Codec, data: bytes) -> object:
    try:
        return envelope_to_record(codec.decode(data))
    except DecodeError as exc:
        return exc.reason


def _event_union_at(data: bytes) -> int:
    """Where the event union's branch number sits: after source, model, dp_rank, epoch,
    seq and event_time (the envelope's fields before it)."""
    pos = HEAD
    for _ in range(2):  # two strings
        n, pos = read_long(data, pos)
        pos += n
    for _ in range(4):  # dp_rank, epoch, seq, event_time
        _, pos = read_long(data, pos)
    return pos


@pytest.mark.parametrize(
    "case",
    ["negative union branch", "varint of 11 bytes", "varint past 64 bits"],
)
@pytest.mark.parametrize("writer", ["current", "released"])
def test_what_fastavro_alone_accepted_the_core_refuses(case: str, writer: str) -> None:
    """Each read a source's EventsLost (which clears its blocks) out of malformed bytes.
    A released writer schema's message is read by the core on that schema's program
    before fastavro resolves it."""
    if writer == "current":
        data = COMPILED.encode(LOST)
    else:  # the last release whose event union ends with EventsLost, as the current one
        data = Codec(schema_json=released_schemas()[-1]).encode(LOST)
        assert Codec().decode(data) == LOST
    at = _event_union_at(data)
    branch = data[at]  # the last branch, EventsLost, as a one-byte zigzag varint
    if case == "negative union branch":  # -1: fastavro indexed from the end
        bad = data[:at] + b"\x01" + data[at + 1 :]
    elif case == "varint of 11 bytes":  # the same number, padded past 10 bytes
        bad = data[:at] + bytes([branch | 0x80]) + b"\x80" * 9 + b"\x00" + data[at + 1 :]
    else:  # a bit past the 64th, which fastavro dropped
        bad = data[:at] + bytes([branch | 0x80]) + b"\x80" * 8 + b"\x02" + data[at + 1 :]
    assert outcome(pure_codec(), bad) != "undecodable"  # what fastavro alone made of them
    assert outcome(COMPILED, bad) == "undecodable"
    assert outcome(ORACLE, bad) == "undecodable"


def test_valid_messages_decode_alike() -> None:
    for env in (STORED, REMOVED):
        data = COMPILED.encode(env)
        assert outcome(COMPILED, data) == outcome(ORACLE, data) == envelope_to_record(env)


@settings(max_examples=400, deadline=None)
@given(
    which=st.sampled_from([STORED, REMOVED]),
    edits=st.lists(
        st.tuples(st.integers(min_value=0, max_value=400), st.integers(0, 255),
                  st.sampled_from(["set", "insert", "delete"])),
        min_size=1, max_size=4,
    ),
    cut=st.integers(min_value=0, max_value=400),
)  # fmt: skip
def test_mutated_messages_get_the_oracles_answer(
    which: Envelope, edits: list[tuple[int, int, str]], cut: int
) -> None:
    data = bytearray(COMPILED.encode(which))
    for offset, byte, how in edits:
        at = HEAD + offset % max(1, len(data) - HEAD)  # the body, not the header
        if how == "set" and at < len(data):
            data[at] = byte
        elif how == "insert":
            data.insert(at, byte)
        elif at < len(data):
            del data[at]
    raw = bytes(data[: max(HEAD, len(data) - cut % 3)])
    assert outcome(COMPILED, raw) == outcome(ORACLE, raw)
