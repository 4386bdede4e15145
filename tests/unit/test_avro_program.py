"""The compiled Avro decoder and encoder (the compiled core, rust/src/avro.rs; programs from
schemas/avro_program.py) against fastavro: the same values for every message a fleet and
the edge cases publish and for generated records, the same bytes written for them, the same
verdicts (and values) for corrupted bytes, and the schemas it leaves to fastavro."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import struct
import subprocess
import sys
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.fleet import FleetConfig
from kvledger.schemas import avro_program
from kvledger.schemas.avro_program import UnsupportedSchemaError, compile_schema
from kvledger.schemas.codec import EVENT_CLASSES, NAMESPACE, Codec, envelope_schema_json
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import BlockRemoved, BlockStored, Envelope, GroupSpec, Heartbeat
from kvledger.schemas.records import envelope_to_record, record_to_envelope
from tests.helpers.streams import edge_stream, fleet_stream

DECODE = avro_program.decoder()
ENCODE = avro_program.encoder()
compiled = pytest.mark.skipif(
    DECODE is None and os.environ.get("CI") != "true",
    reason="the compiled core was not built (no Rust toolchain); CI requires it",
)
SCHEMA = fastavro.parse_schema(json.loads(envelope_schema_json()))
PROGRAM = compile_schema(json.loads(envelope_schema_json()))
OBJECTS = compile_schema(
    json.loads(envelope_schema_json()),
    {f"{NAMESPACE}.{cls.__name__}": cls for cls in (Envelope, *EVENT_CLASSES)},
)
# KVLEDGER_PURE_AVRO=1 keeps the codec on fastavro; the extension is still tested directly.
CODEC_COMPILED = Codec()._compiled is not None


def by_fastavro(data: bytes) -> tuple[Any, int] | None:
    stream = io.BytesIO(data)
    stream.seek(10)
    try:
        record = fastavro.schemaless_reader(stream, SCHEMA, SCHEMA, return_record_name=True)
    except Exception:
        return None
    return record, stream.tell()


def fastavro_bytes(codec: Codec, env: Envelope) -> bytes:
    """What the codec wrote before the compiled encoder: fastavro on the mapped record."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, SCHEMA, envelope_to_record(env))
    return codec.encode(Envelope("s", "m", 0, 0, 0, 0, Heartbeat()))[:10] + out.getvalue()


def by_program(data: bytes) -> tuple[Any, int] | None:
    assert DECODE is not None
    try:
        return DECODE(PROGRAM, data, 10)
    except Exception:
        return None


def published() -> list[bytes]:
    return [m.value for m in edge_stream().messages] + [
        m.value for m in fleet_stream(FleetConfig(instances=2, requests=15, seed=4)).messages
    ]


def test_ci_builds_the_compiled_decoder() -> None:
    if os.environ.get("CI") == "true":
        assert DECODE is not None, "CI must build the compiled core (rust/: is cargo there?)"
        assert ENCODE is not None and CODEC_COMPILED and Codec()._encode is ENCODE


@compiled
def test_every_published_message_decodes_as_fastavro_decodes_it() -> None:
    messages = published()
    assert len(messages) > 500
    kinds = set()
    codec = Codec()
    for data in messages:  # the edge cases include bytes neither can decode
        ours = by_program(data)
        theirs = by_fastavro(data)
        assert ours == theirs
        if ours is not None and theirs is not None:
            kinds.add(ours[0]["event"][0])
            # Straight into the codec's types: what fastavro's record maps onto.
            env = codec.decode(data)
            assert env == record_to_envelope(theirs[0])
            # And written back as fastavro writes it.
            assert codec.encode(env) == fastavro_bytes(codec, env) == data
    assert len(kinds) >= 5, kinds


@compiled
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=5),
    st.one_of(st.none(), st.binary(max_size=40)),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70),
    st.one_of(st.none(), st.text(max_size=20)),
    st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    st.one_of(st.none(), st.lists(st.one_of(st.none(), st.text(max_size=8)), max_size=4)),
    st.booleans(),
    st.one_of(
        st.none(), st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3), max_size=3)
    ),
)
def test_generated_records_decode_alike(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], text: str | None,
    start: int | None, extra: list[str | None] | None, partial: bool,
    lookahead: list[list[int]] | None,
) -> None:  # fmt: skip
    event = BlockStored(
        tuple(hashes), parent, tuple(tokens), 16, None, text, text,
        tuple(extra) if extra is not None else None, None, text, None, text, text, start,
        partial, text, tuple(tuple(x) for x in lookahead) if lookahead is not None else None,
    )  # fmt: skip
    for env in (
        Envelope("é-source", "m", 3, -5, 2**62, 0, event, engine_seq=start),
        Envelope("s", "", 0, 1, 0, -1, Heartbeat(group_idx=None, interval_ms=start)),
    ):
        data = Codec().encode(env)
        assert data == fastavro_bytes(Codec(), env)
        ours, theirs = by_program(data), by_fastavro(data)
        assert ours is not None and ours == theirs
        decoded = Codec().decode(data)
        assert decoded == env == record_to_envelope(theirs[0])
        assert type(decoded.event) is type(env.event)


@compiled
def test_corrupted_bytes_get_the_same_verdict() -> None:
    """Bytes flipped, cut, inserted: where fastavro decodes them, the program decodes the
    same value to the same offset; where it refuses them, so does the program. They may
    differ in one way only: the program is stricter, refusing a negative union index (which
    fastavro takes as a Python index from the end) and a varint past 64 bits."""
    rng = random.Random(11)
    messages = published()
    agreed = refused = stricter = 0
    codec = Codec()
    for _ in range(6000):
        data = bytearray(rng.choice(messages))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(10, len(data))
            kind = rng.randrange(3)
            if kind == 0:
                data[at] = rng.randrange(256)
            elif kind == 1:
                del data[at:]
                if len(data) <= 10:
                    data += b"\x00"
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        ours, theirs = by_program(bytes(data)), by_fastavro(bytes(data))
        try:  # straight into objects: the same verdict, nothing but a DecodeError
            envelope: Envelope | None = codec.decode(bytes(data))
        except DecodeError:
            envelope = None
        if CODEC_COMPILED:
            assert (envelope is None) == (ours is None or ours[1] != len(data))  # trailing
        if theirs is None:
            assert ours is None, bytes(data).hex()
            refused += 1
        elif ours is not None:
            assert ours == theirs, bytes(data).hex()
            agreed += 1
        else:
            assert DECODE is not None
            with pytest.raises(ValueError, match=r"union branch out of range|64 bits|10 bytes"):
                DECODE(PROGRAM, bytes(data), 10)
            stricter += 1
    assert agreed > 500 and refused > 500 and stricter < agreed / 10


@compiled
def test_the_decoder_refuses_what_it_cannot_read() -> None:
    assert DECODE is not None
    good = Codec().encode(Envelope("s", "m", 0, 1, 2, 3, Heartbeat(group_idx=0)))
    with pytest.raises(ValueError, match="truncated"):
        DECODE(PROGRAM, good[:-1], 10)
    with pytest.raises(ValueError, match="offset"):
        DECODE(PROGRAM, good, len(good) + 1)
    array_of_longs = compile_schema({"type": "array", "items": "long"})
    with pytest.raises(ValueError, match="longer than the message"):
        DECODE(array_of_longs, b"\x80\x80\x80\x80\x08", 0)  # 2**31 items in 0 bytes
    assert DECODE(array_of_longs, b"\x03\x04\x04\x06\x00", 0) == ([2, 3], 5)  # -2: sized block
    with pytest.raises(ValueError, match="64 bits"):
        DECODE((avro_program.LONG,), b"\xff" * 9 + b"\x7f", 0)
    with pytest.raises(UnicodeDecodeError):
        DECODE((avro_program.STRING,), b"\x02\xff", 0)
    with pytest.raises(ValueError, match="branch"):
        DECODE(compile_schema(["null", "long"]), b"\x04", 0)
    assert DECODE((avro_program.FLOAT,), struct.pack("<f", 1.5), 0) == (1.5, 4)
    assert DECODE((avro_program.DOUBLE,), struct.pack("<d", -0.1), 0) == (-0.1, 8)
    with pytest.raises(ValueError, match="truncated"):
        DECODE((avro_program.DOUBLE,), b"\x00" * 7, 0)


@compiled
def test_the_encoder_refuses_what_no_reader_could_take() -> None:
    """Where fastavro would write an int past its type's range or a value of another type
    as best it can, the compiled encoder raises; a boolean takes any truth value."""
    assert ENCODE is not None
    codec = Codec()

    ok = Envelope("s", "m", 0, 1, 2, 3, Heartbeat(group_idx=0))
    header = fastavro_bytes(codec, ok)[:10]

    def encode(env: Envelope) -> bytes:
        assert ENCODE is not None
        return ENCODE(OBJECTS, env, header)

    spec = GroupSpec("m", 0, "full_attention", 16, 16, surviving_media=("CPU",))
    truthy = Envelope("s", "m", 0, 1, 2, 3, dataclasses.replace(stored_event(), partial=1))  # type: ignore[arg-type]
    for env in (ok, Envelope("s", "m", 0, 1, 2, 3, spec), truthy):
        assert encode(env) == fastavro_bytes(codec, env)

    class Index:  # an integer of another library (numpy's, say)
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    ints = dataclasses.replace(stored_event(), token_ids=(Index(1), Index(2)))  # type: ignore[arg-type]
    assert encode(dataclasses.replace(truthy, event=ints)) == encode(
        dataclasses.replace(truthy, event=stored_event())
    )
    for bad, error, match in (
        (dataclasses.replace(ok, seq=2**63), ValueError, "out of range for an Avro long"),
        (dataclasses.replace(ok, dp_rank=2**31), ValueError, "out of range for an Avro int"),
        (dataclasses.replace(ok, source=b"s"), TypeError, "does not fit"),  # type: ignore[arg-type]
        (dataclasses.replace(ok, epoch=1.0), TypeError, "does not fit"),  # type: ignore[arg-type]
        (dataclasses.replace(ok, engine_seq="1"), ValueError, "no branch"),  # type: ignore[arg-type]
        (dataclasses.replace(ok, event=object()), ValueError, "no branch"),  # type: ignore[arg-type]
        (Envelope("s", "m", 0, 1, 2, 3, BlockRemoved(("h",), None)), TypeError, "does not fit"),  # type: ignore[arg-type]
        (Envelope("s", "m", 0, 1, 2, 3, BlockRemoved(None, None)), TypeError, "list or a tuple"),  # type: ignore[arg-type]
    ):  # fmt: skip
        with pytest.raises(error, match=match):
            encode(bad)
        if CODEC_COMPILED:  # the codec raises as its encoder does
            with pytest.raises(error, match=match):
                codec.encode(bad)


@compiled
def test_dict_programs_encode_as_fastavro_writes() -> None:
    """Records as dicts (the program the decoder returns dicts with) encode too; a missing
    key is null, as in fastavro."""
    assert ENCODE is not None
    schema = {"type": "record", "name": "R", "fields": [
        {"name": "a", "type": "long"}, {"name": "b", "type": ["null", "string"]},
        {"name": "c", "type": {"type": "array", "items": "int"}},
        {"name": "d", "type": "double"}, {"name": "e", "type": "float"},
    ]}  # fmt: skip
    program, parsed = compile_schema(schema), fastavro.parse_schema(schema)
    for record in (
        {"a": -5, "b": "é", "c": [1, 2, 3], "d": 0.1, "e": 1.5},
        {"a": 2**63 - 1, "c": (), "d": -1, "e": 0},
    ):
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, record)
        assert ENCODE(program, record, b"") == out.getvalue()
    with pytest.raises(TypeError, match="needs a dict"):
        ENCODE(program, [1], b"")


@compiled
def test_a_union_takes_the_first_branch_its_value_fits() -> None:
    assert ENCODE is not None
    schema = ["null", "int", "long", "double", "string"]
    program, parsed = compile_schema(schema), fastavro.parse_schema(schema)
    for value in (None, 5, -(2**31), 2**31, -(2**40), 0.5, "x"):
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, value)
        assert ENCODE(program, value, b"") == out.getvalue(), value

    class Index:
        def __index__(self) -> int:
            return 2**40

    assert ENCODE(compile_schema(["null", "long"]), Index(), b"") == b"\x02\x80\x80\x80\x80\x80\x40"
    with pytest.raises(ValueError, match="no branch"):
        ENCODE(compile_schema(["null", "long"]), True, b"")


def stored_event() -> BlockStored:
    return BlockStored((b"h" * 8,), None, (1, 2), 2, None, "GPU", None)


def test_schemas_beyond_the_decoder_stay_with_fastavro() -> None:
    for schema in (
        {"type": "map", "values": "long"},
        {"type": "enum", "name": "E", "symbols": ["A"]},
        {"type": "fixed", "name": "F", "size": 4},
        {"type": "long", "logicalType": "timestamp-millis"},
        {"type": "array", "items": "null"},
        {"type": "record", "name": "R", "fields": [{"name": "next", "type": ["null", "R"]}]},
    ):
        with pytest.raises(UnsupportedSchemaError):
            compile_schema(schema)
    # In object mode too, array items must take at least one byte (the decoder's count
    # bound relies on it).
    empty = {"type": "record", "name": "E", "fields": [{"name": "x", "type": "null"}]}
    with pytest.raises(UnsupportedSchemaError, match="no byte"):
        compile_schema({"type": "array", "items": empty}, {"E": _Nothing})
    # Straight into classes: only slotted dataclasses whose fields are the record's.
    record = {"type": "record", "name": "P", "fields": [{"name": "x", "type": "long"}]}
    for classes in ({"Q": Heartbeat}, {"P": Heartbeat}, {"P": dict}):
        with pytest.raises(UnsupportedSchemaError):
            compile_schema(record, classes)
    union = compile_schema(
        ["null", {"type": "record", "name": "A", "namespace": "x", "fields": []}, "x.A"]
    )
    assert union[2] == (None, "x.A", "x.A")


@dataclasses.dataclass(frozen=True, slots=True)
class _Nothing:
    x: None


@compiled
def test_a_slot_borrowed_from_another_class_is_refused() -> None:
    """A program whose object slot is another class's descriptor (an offset into that
    class's objects, past the end of this one's) is refused before any byte is read or
    written, not followed."""
    assert DECODE is not None and ENCODE is not None
    big = type("Big", (), {"__slots__": tuple(f"s{i}" for i in range(40))})
    small = type("Small", (), {"__slots__": ("a",)})
    borrowed = (avro_program.OBJECT, small, (big.__dict__["s39"],), ((avro_program.LONG,),))
    with pytest.raises(TypeError, match="not a slot of the class"):
        DECODE(borrowed, b"\x02", 0)
    with pytest.raises(TypeError, match="not a slot of the class"):
        ENCODE(borrowed, small(), b"")
    own = (avro_program.OBJECT, small, (small.__dict__["a"],), ((avro_program.LONG,),))
    value, end = DECODE(own, b"\x02", 0)
    assert (type(value), value.a, end) == (small, 1, 1)
    assert ENCODE(own, value, b"h") == b"h\x02"


@compiled
@pytest.mark.parametrize("base", ["dict", "set", "collections.deque", "Exception", "list"])
def test_a_class_a_bare_allocation_would_leave_half_made_is_refused(base: str) -> None:
    """A program naming a slotted subclass of dict, set, deque or an exception crashed the
    interpreter (an instance allocated without its base's own set-up, then used): refused
    when compiled. Run in a child process, so a crash fails the test instead of ending it."""
    script = f"""
import collections
from kvledger.schemas import avro_program
cls = type("Sub", ({base},), {{"__slots__": ("a",)}})
program = (avro_program.OBJECT, cls, (cls.__dict__["a"],), ((avro_program.LONG,),))
try:
    value, _ = avro_program.decoder()(program, b"\\x02", 0)
    print("made", repr(value), len(str(value)))
except TypeError as exc:
    print("refused", exc)
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-500:])
    assert run.stdout.startswith("refused") and "object.__new__ alone" in run.stdout, run.stdout
