"""The wire contract: round trips, the Apache avro reference reader, framing, evolution."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import struct

import avro.io
import avro.schema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.schemas.codec import (
    SINGLE_OBJECT_MAGIC,
    Codec,
    envelope_schema_json,
    released_schemas,
    schema_fingerprint,
)
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    Goodbye,
    GroupSpec,
    Heartbeat,
)

EVENTS = [
    BlockStored(
        block_hashes=(b"\x01" * 32, b"\x02" * 32),
        parent_block_hash=b"\x00" * 32,
        token_ids=tuple(range(32)),
        block_size=16,
        lora_id=4,
        medium="CPU",
        lora_name="adapter",
        extra_keys=('["adapter"]', None),
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        locality="LOCAL",
        ownership=None,
        token_start=2048,
        partial=False,
    ),
    BlockStored(
        (b"\x09" * 8,),
        None,
        (),
        0,
        None,
        "STORAGE",
        None,
        group_idx=2,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="REMOTE",
        ownership="disk",
    ),
    BlockStored(
        (b"\x03" * 8,),
        b"\x04" * 8,
        (1, 2, 3, 4),
        4,
        None,
        "CPU",
        None,
        group_idx=0,
        token_start=16,
        partial=True,
    ),
    BlockRemoved((b"\x01" * 32, b"\x02" * 32), "CPU", 1, "LOCAL", None),
    BlockRemoved((b"\x07" * 8,), "STORAGE", None, None, "disk"),
    AllBlocksCleared(group_idx=3, medium="GPU"),
    GroupSpec("llama-3-8b", 0, "full_attention", 16, 16, None),
    GroupSpec("llama-3-8b", 1, "sliding_window", 32, 16, 4096),
]


def envelope(event: object, seq: int = 7) -> Envelope:
    return Envelope("engine-0", "llama-3-8b", 1, 1_764_000_000_000, seq, 1_764_000_000_123, event)  # type: ignore[arg-type]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip(event: object) -> None:
    codec = Codec()
    env = envelope(event)
    data = codec.encode(env)
    assert data[:2] == SINGLE_OBJECT_MAGIC
    assert struct.unpack_from("<Q", data, 2)[0] == codec.fingerprint
    assert codec.decode(data) == env


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_apache_avro_reads_our_bytes(event: object) -> None:
    codec = Codec()
    data = codec.encode(envelope(event))
    schema = avro.schema.parse(envelope_schema_json())
    reader = avro.io.DatumReader(schema)
    record = reader.read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
    assert record["source"] == "engine-0"
    assert record["seq"] == 7
    body = record["event"]
    for name in ("block_hashes", "token_ids", "block_size", "model", "kind"):
        if hasattr(event, name):
            got = body[name]
            want = getattr(event, name)
            assert (tuple(got) if isinstance(got, list) else got) == want


def test_fingerprint_matches_apache_avro() -> None:
    # The reference library's canonical form, fingerprinted independently (CRC-64-AVRO).
    canonical = str(avro.schema.parse(envelope_schema_json()).canonical_form)
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in canonical.encode():
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    assert Codec().fingerprint == fp


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "undecodable"),
        (b"hello world", "undecodable"),
        (SINGLE_OBJECT_MAGIC + b"\x01\x02", "undecodable"),
        (SINGLE_OBJECT_MAGIC + struct.pack("<Q", 12345) + b"\x00\x00", "unknown_schema"),
    ],
)
def test_bad_bytes_raise_decode_error(data: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        Codec().decode(data)
    assert info.value.reason == reason


def test_truncated_and_trailing_bytes() -> None:
    codec = Codec()
    data = codec.encode(envelope(EVENTS[0]))
    for cut in (11, len(data) // 2, len(data) - 1):
        with pytest.raises(DecodeError) as info:
            codec.decode(data[:cut])
        assert info.value.reason == "undecodable"
    with pytest.raises(DecodeError, match="trailing"):
        codec.decode(data + b"\x00")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_decode_error(data: bytes) -> None:
    codec = Codec()
    for candidate in (data, SINGLE_OBJECT_MAGIC + struct.pack("<Q", codec.fingerprint) + data):
        with contextlib.suppress(DecodeError):
            codec.decode(candidate)


# ---------------------------------------------------------------- evolution
def _older_schema() -> str:
    """The envelope as a version 1 writer would have had it: no token_start/partial/locality."""
    schema = json.loads(envelope_schema_json())
    for field in schema["fields"]:
        if field["name"] == "event":
            for branch in field["type"]:
                if branch["name"] == "BlockStored":
                    branch["fields"] = [
                        f
                        for f in branch["fields"]
                        if f["name"] not in {"token_start", "partial", "locality"}
                    ]
    return json.dumps(schema)


def test_old_writer_new_reader() -> None:
    old = _older_schema()
    writer = Codec(schema_json=old)
    reader = Codec(known_writers=[old])
    assert writer.fingerprint != reader.fingerprint
    event = BlockStored(
        (b"\x01" * 8,),
        None,
        (1, 2),
        2,
        None,
        "CPU",
        None,
        group_idx=0,
        locality="LOCAL",
        token_start=64,
        partial=True,
    )
    decoded = reader.decode(writer.encode(envelope(event)))
    assert isinstance(decoded.event, BlockStored)
    # Fields the old writer lacked take the reader's defaults.
    assert (decoded.event.token_start, decoded.event.partial, decoded.event.locality) == (
        None,
        False,
        None,
    )
    assert decoded.event.token_ids == (1, 2)
    # Without knowing the old writer, the reader refuses with a typed error.
    with pytest.raises(DecodeError) as info:
        Codec().decode(writer.encode(envelope(event)))
    assert info.value.reason == "unknown_schema"


def test_new_writer_old_reader() -> None:
    old = _older_schema()
    reader = Codec(schema_json=old, known_writers=[envelope_schema_json()])
    data = Codec().encode(envelope(EVENTS[0]))
    record = reader.decode_record(data)
    _, body = record["event"]
    assert "token_start" not in body
    assert body["token_ids"] == list(range(32))


def test_schema_fingerprint_is_stable_under_formatting() -> None:
    text = envelope_schema_json()
    assert schema_fingerprint(text) == schema_fingerprint(json.dumps(json.loads(text), indent=2))


# ---------------------------------------------------------------- confluent framing
def test_confluent_framing_with_mock_registry() -> None:
    from confluent_kafka.schema_registry import SchemaRegistryClient

    registry = SchemaRegistryClient.new_client({"url": "mock://kvledger-test"})
    codec = Codec(registry=registry, subject="kv-events-value")
    env = envelope(EVENTS[3])
    data = codec.encode(env)
    assert data[0] == 0
    schema_id = struct.unpack_from(">I", data, 1)[0]
    assert registry.get_schema(schema_id).schema_type == "AVRO"
    # A second reader fetches the writer schema from the registry by id.
    reader = Codec(registry=registry, subject="kv-events-value")
    assert reader.decode(data) == env
    with pytest.raises(DecodeError) as info:
        reader.decode(b"\x00" + struct.pack(">I", 999_999) + data[5:])
    assert info.value.reason == "unknown_schema"


def test_the_reuse_report_flag_both_ways() -> None:
    """0.1.1 → now: what producers wrote until the flag existed reads as not reporting;
    now → 0.1.1: an old consumer reads the announcement without it (upgrade consumers
    before relays set --report-mode full)."""
    [previous] = [s for s in released_schemas() if "session_id" in s and "reports_reuse" not in s]
    old_writer, old_reader = (
        Codec(schema_json=previous),
        Codec(schema_json=previous, known_writers=[envelope_schema_json()]),
    )
    kept = GroupSpec("m", 0, "full_attention", 16, 16, None, ("CPU",))
    assert Codec().decode(old_writer.encode(envelope(kept))).event == kept
    reporting = dataclasses.replace(kept, reports_reuse=True)
    new_bytes = Codec().encode(envelope(reporting))
    assert Codec().decode(new_bytes).event == reporting
    assert old_reader.decode(new_bytes).event == kept


def test_the_engines_load_both_ways() -> None:
    """0.2.0 → now: a heartbeat without the load reads as not read (None); now → 0.2.0: an
    old consumer that knows the new schema reads the heartbeat, load left out (relays may
    send it before every consumer is upgraded)."""
    [previous] = [
        s for s in released_schemas() if "reports_reuse" in s and "requests_running" not in s
    ]
    old_writer, old_reader = (
        Codec(schema_json=previous),
        Codec(schema_json=previous, known_writers=[envelope_schema_json()]),
    )
    assert Codec().decode(old_writer.encode(envelope(Heartbeat(0, 1000)))).event == (
        Heartbeat(0, 1000, None, None)
    )
    busy = Heartbeat(0, 1000, requests_running=7, requests_waiting=3)
    new_bytes = Codec().encode(envelope(busy))
    assert Codec().decode(new_bytes).event == busy
    assert old_reader.decode(new_bytes).event == Heartbeat(0, 1000)


def test_the_lifecycle_contract_both_ways() -> None:
    """0.1.0 → now: an old producer's announcement reads with the default policy (None);
    now → 0.1.0: an old consumer that knows the new schema reads the announcement without
    the new field, and cannot read the new event types (upgrade consumers first)."""
    released = released_schemas()[0]
    old_writer, old_reader = (
        Codec(schema_json=released),
        Codec(schema_json=released, known_writers=[envelope_schema_json()]),
    )
    announced = GroupSpec("m", 0, "full_attention", 32, 16, None, ("CPU", "STORAGE"))
    assert Codec().decode(old_writer.encode(envelope(GroupSpec("m", 0, "mamba", 4, 4)))).event == (
        GroupSpec("m", 0, "mamba", 4, 4, None, None)
    )
    new_bytes = Codec().encode(envelope(announced))
    assert Codec().decode(new_bytes).event == announced
    assert old_reader.decode(new_bytes).event == GroupSpec("m", 0, "full_attention", 32, 16)
    with pytest.raises(DecodeError):
        old_reader.decode(Codec().encode(envelope(Heartbeat(0, 5000))))
    for event in (Heartbeat(1, 5000), Goodbye(2), Goodbye()):
        assert Codec().decode(Codec().encode(envelope(event))).event == event
