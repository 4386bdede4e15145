"""Avro encoding of envelopes: schemas parsed once, framing that names the writer schema.

Framing (default): Avro single-object encoding, ``C3 01`` + the writer schema's 8-byte
little-endian CRC-64-AVRO fingerprint + the Avro binary body. A reader resolves the writer
schema by fingerprint among the schemas it knows (the current one and any registered older
versions) and decodes into its own reader schema following Avro's resolution rules.

Optional Confluent Schema Registry framing: ``00`` + 4-byte big-endian schema id + body, with
the writer schema fetched from the registry by id.

Every decoding failure raises :class:`~schemas.errors.DecodeError`; nothing else escapes,
but for a registry that does not answer when a writer schema must be fetched from it
(:class:`~kvledger.schemas.registry.RegistryUnavailableError`: no message is at fault, and
the reader waits for the registry). The records fastavro reads and writes map onto the
types in :mod:`.records`.

Strictness is the compiled core's (rust/src/wire.rs): a message written with the codec's
own schema is decoded by it; one written with another schema (an older release's, a
registry's) is read through it first, on that writer's program, and only then resolved by
fastavro, which alone is lenient (it takes a negative union branch as one counted from the
end, and varints past 10 bytes or 64 bits). Every reader of the index (the consumer, the
router) needs the core anyway. Without it (an engine's install built without cargo, or
KVLEDGER_PURE_AVRO=1) the codec still encodes the same bytes, and decodes with fastavro
alone: only the relay decodes there, reading back the last messages it wrote.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Any, Protocol

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from kvledger.schemas.avro_program import (
    Decoder,
    Program,
    UnsupportedSchemaError,
    compile_schema,
    decoder,
    encoder,
)
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventsLost,
    Goodbye,
    GroupSpec,
    Heartbeat,
    KVEvent,
)
from kvledger.schemas.records import envelope_to_record, record_to_envelope

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
EVENT_CLASSES = (
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
    GroupSpec,
    Heartbeat,
    Goodbye,
    EventsLost,
)
EVENT_TYPES = tuple(cls.__name__ for cls in EVENT_CLASSES)  # the union's branches, in order
NAMESPACE = "kvledger"
_FP = struct.Struct("<Q")
_CONFLUENT_ID = struct.Struct(">I")


def _load(name: str) -> dict[str, Any]:
    text = resources.files("kvledger.schemas").joinpath("avro", f"{name}.avsc").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@cache
def envelope_schema_json() -> str:
    """The full envelope schema with every event record inlined (the .avsc files composed)."""
    envelope = _load("Envelope")
    events = {f"{NAMESPACE}.{name}": _load(name) for name in EVENT_TYPES}
    for field in envelope["fields"]:
        if field["name"] == "event":
            field["type"] = [events[ref] for ref in field["type"]]
    return json.dumps(envelope)


@cache
def released_schemas() -> tuple[str, ...]:
    """Every envelope schema an earlier release wrote (avro/released/): a reader accepts
    them all, so producers of an older release keep feeding a newer consumer."""
    folder = resources.files("kvledger.schemas").joinpath("avro", "released")
    return tuple(
        json.dumps(json.loads(entry.read_text("utf-8")))
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".json")
    )


def schema_fingerprint(schema_json: str) -> int:
    """CRC-64-AVRO fingerprint of a schema's Parsing Canonical Form, as an unsigned int."""
    canonical = to_parsing_canonical_form(fastavro.parse_schema(json.loads(schema_json)))
    # fastavro gives the fingerprint's bytes in little-endian order, as they go on the wire.
    return int.from_bytes(bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")), "little")


class SchemaRegistry(Protocol):
    """The part of confluent_kafka's SchemaRegistryClient the codec uses."""

    def register_schema(self, subject_name: str, schema: Any) -> int: ...
    def get_schema(self, schema_id: int) -> Any: ...


class Codec:
    """Encodes and decodes envelopes. Schemas are parsed once; instances are thread-safe.

    ``schema_json`` is the writer (and reader) schema, the current one by default.
    ``known_writers`` adds older or newer writer schemas a reader must accept (default:
    every released one, :func:`released_schemas`).
    With ``registry``, it also reads Confluent Schema Registry framing (the writer schema
    fetched by id, never registered); with ``subject`` too it writes that framing, after
    registering the schema under the subject (see :mod:`kvledger.schemas.registry`).
    """

    def __init__(
        self,
        schema_json: str | None = None,
        known_writers: Iterable[str] | None = None,
        registry: SchemaRegistry | None = None,
        subject: str | None = None,
    ) -> None:
        self.schema_json = schema_json or envelope_schema_json()
        self._schema = fastavro.parse_schema(json.loads(self.schema_json))
        # Messages written with this very schema decode through the compiled decoder where
        # it was built (the same values as fastavro and record_to_envelope, ~6x faster);
        # the others with fastavro.
        self._core = _core_decoder()
        self._program, self._objects, self._compiled = _compiled_programs(
            self.schema_json, self._core
        )
        # And encode through the compiled encoder (the same bytes, ~8x faster).
        self._encode = encoder() if self._compiled is not None else None
        self.fingerprint = schema_fingerprint(self.schema_json)
        # Whether the producer may frame this codec's messages itself (envelope_head).
        self.frames_current = self.fingerprint == schema_fingerprint(envelope_schema_json())
        self._header = SINGLE_OBJECT_MAGIC + _FP.pack(self.fingerprint)
        self._writers: dict[int, Any] = {self.fingerprint: self._schema}
        # Each writer schema's program, which the core reads a body with before fastavro
        # resolves it (None: a schema beyond the core, refused where the core is in use).
        self._checks: dict[int, Program | None] = {id(self._schema): _check(self.schema_json)}
        for writer in released_schemas() if known_writers is None else known_writers:
            parsed = fastavro.parse_schema(json.loads(writer))
            self._writers[schema_fingerprint(writer)] = parsed
            self._checks[id(parsed)] = _check(writer)
        # The single-object header of this codec's own schema where the compiled decoder
        # reads it: such a message (nearly every one) goes to it at once.
        own = self._compiled is not None and self._writers.get(self.fingerprint) is self._schema
        self._own_header = SINGLE_OBJECT_MAGIC + _FP.pack(self.fingerprint) if own else None
        self._registry = registry
        self._registry_writers: dict[int, Any] = {}
        if registry is not None and subject is not None:  # a writer: register, then frame
            schema_id = self._register(registry, subject)
            self._header = CONFLUENT_MAGIC + _CONFLUENT_ID.pack(schema_id)
            self._registry_writers[schema_id] = self._schema

    def _register(self, registry: SchemaRegistry, subject: str) -> int:
        """Register the envelope schema under ``subject``. The registry checks it against the
        subject's compatibility rule as it registers; a refusal (HTTP 409) is raised as
        :class:`~kvledger.schemas.registry.SchemaIncompatibleError`."""
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        from kvledger.schemas.registry import (
            RegistryUnavailableError,
            SchemaIncompatibleError,
            refusal,
        )

        try:
            schema_id: int = registry.register_schema(subject, Schema(self.schema_json, "AVRO"))
        except SchemaRegistryError as exc:
            if exc.http_status_code == 409:
                raise SchemaIncompatibleError(
                    f"the registry refuses kvledger's envelope schema under subject {subject!r} "
                    f"as incompatible ({exc.error_message}): upgrade readers first, or check "
                    "the subject's compatibility rule"
                ) from exc
            raise RegistryUnavailableError(
                f"the schema registry refused to register subject {subject!r}: {refusal(exc)}"
            ) from exc
        except Exception as exc:  # transport: refused, timed out, TLS
            raise RegistryUnavailableError(f"the schema registry did not answer: {exc}") from exc
        return schema_id

    @property
    def registry(self) -> SchemaRegistry | None:
        """The Schema Registry client this codec resolves (and, as a writer, registers) with."""
        return self._registry

    # ------------------------------------------------------------------ encode
    def envelope_head(self, source: str, model: str, dp_rank: int, epoch: int) -> bytes:
        """What every message of one source, model, rank and epoch starts with: the header,
        then the envelope's first four fields (the current schema's order). The producer
        writes the rest (:func:`kvledger.producer.prepared.frame`); only where
        :attr:`frames_current`."""
        if not self.frames_current:
            raise ValueError("this codec's messages are framed by its encoder alone")
        if not -(2**31) <= dp_rank < 2**31 or not -(2**63) <= epoch < 2**63:
            raise ValueError(f"dp_rank {dp_rank} or epoch {epoch} is out of its Avro range")
        out = bytearray(self._header)
        for text in (source, model):
            data = text.encode()
            out += zigzag(len(data)) + data
        return bytes(out + zigzag(dp_rank) + zigzag(epoch))

    def event_branch(self, event: KVEvent) -> bytes:
        """An event as its envelope's event branch (the union index, then the record): what
        the producer frames with :meth:`envelope_head`. Raises as
        :meth:`encode` does; only where :attr:`frames_current`."""
        if not self.frames_current:
            raise ValueError("this codec's messages are framed by its encoder alone")
        data = self.encode(Envelope("", "", 0, 0, 0, 0, event))
        # Before it: the header, then two empty strings and four zeros (a byte each); after
        # it: the null engine_seq (a byte).
        return data[len(self._header) + 6 : -1]

    def encode(self, envelope: Envelope) -> bytes:
        if self._encode is not None:
            return self._encode(self._objects, envelope, self._header)
        out = io.BytesIO()
        out.write(self._header)
        fastavro.schemaless_writer(out, self._schema, envelope_to_record(envelope))
        return out.getvalue()

    # ------------------------------------------------------------------ decode
    def decode(self, data: bytes) -> Envelope:
        """Decode one message; raises :class:`DecodeError`, or
        :class:`~kvledger.schemas.registry.RegistryUnavailableError` where the writer schema
        must come from a registry that does not answer (the message is not at fault)."""
        own = self._own_header
        if own is not None and type(data) is bytes and data.startswith(own):
            fast: Envelope = self._run(self._objects, data, len(own))
            return fast
        data, writer, header_len = self._framed(data)
        if writer is self._schema and self._compiled is not None:
            envelope: Envelope = self._run(self._objects, data, header_len)
            return envelope
        record = self._fastavro(data, writer, header_len)
        try:
            return record_to_envelope(record)
        except DecodeError:
            raise
        except Exception as exc:  # a resolved record that does not map onto the types
            raise DecodeError("undecodable", f"record does not form an envelope: {exc!r}") from exc

    def decode_record(self, data: bytes) -> dict[str, Any]:
        """One message as the Avro record fastavro gives (union branches named)."""
        data, writer, header_len = self._framed(data)
        if writer is self._schema and self._compiled is not None:
            record: dict[str, Any] = self._run(self._program, data, header_len)
            return record
        return self._fastavro(data, writer, header_len)

    def resolve_writers(self, values: Iterable[bytes]) -> None:
        """Fetch the registry's writer schemas these messages name that are not known yet,
        so that decoding them asks nothing of the network (a caller does this before it
        takes a lock decoding runs under). Raises
        :class:`~kvledger.schemas.registry.RegistryUnavailableError` as :meth:`decode` does;
        a message that names no schema, or one the registry refuses, is left to
        :meth:`decode`'s own refusal."""
        if self._registry is None:
            return
        for data in values:
            if data[:1] == CONFLUENT_MAGIC and len(data) >= 5:
                (schema_id,) = _CONFLUENT_ID.unpack_from(data, 1)
                if schema_id not in self._registry_writers:
                    with contextlib.suppress(DecodeError):
                        self._fetch_writer(schema_id)

    def _framed(self, data: bytes) -> tuple[bytes, Any, int]:
        """The message as bytes, its writer schema, and where its body starts."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DecodeError("undecodable", f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        writer = self._writer_for(data)
        return data, writer, 10 if data[:2] == SINGLE_OBJECT_MAGIC else 5

    def _run(self, program: Program, data: bytes, header_len: int) -> Any:
        """The compiled decoder on the body, with the program of the schema it was written
        with."""
        assert self._core is not None
        try:
            value, end = self._core(program, data, header_len)
        except Exception as exc:
            raise DecodeError("undecodable", f"Avro body does not decode: {exc!r}") from exc
        if end != len(data):
            raise DecodeError("undecodable", f"{len(data) - end} trailing bytes after the record")
        return value

    def _fastavro(self, data: bytes, writer: Any, header_len: int) -> dict[str, Any]:
        if self._core is not None:  # the core's refusals first: fastavro alone is lenient
            check = self._checks.get(id(writer))
            if check is None:
                raise DecodeError(
                    "unknown_schema", "the writer schema is beyond the compiled decoder"
                )
            self._run(check, data, header_len)
        stream = io.BytesIO(data)
        stream.seek(header_len)
        try:
            record = fastavro.schemaless_reader(
                stream, writer, self._schema, return_record_name=True
            )
        except Exception as exc:
            raise DecodeError("undecodable", f"Avro body does not decode: {exc!r}") from exc
        if stream.tell() != len(data):
            raise DecodeError(
                "undecodable", f"{len(data) - stream.tell()} trailing bytes after the record"
            )
        if not isinstance(record, dict):
            raise DecodeError("undecodable", "the body is not a record")
        return record

    def _writer_for(self, data: bytes) -> Any:
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < 10:
                raise DecodeError("undecodable", f"truncated header ({len(data)} bytes)")
            (fp,) = _FP.unpack_from(data, 2)
            writer = self._writers.get(fp)
            if writer is None:
                raise DecodeError("unknown_schema", f"unknown writer fingerprint {fp:016x}")
            return writer
        if data[:1] == CONFLUENT_MAGIC and self._registry is not None:
            if len(data) < 5:
                raise DecodeError("undecodable", f"truncated header ({len(data)} bytes)")
            (schema_id,) = _CONFLUENT_ID.unpack_from(data, 1)
            writer = self._registry_writers.get(schema_id)
            return writer if writer is not None else self._fetch_writer(schema_id)
        raise DecodeError(
            "undecodable", f"unknown framing, first bytes {data[:4].hex() or '(empty)'}"
        )

    def _fetch_writer(self, schema_id: int) -> Any:
        """The writer schema of ``schema_id``, asked of the registry (then kept). An id the
        registry says it does not hold is the message's fault (``unknown_schema``: it is
        dead-lettered); a registry that does not answer, or not as a schema registry
        would, is not: :class:`~kvledger.schemas.registry.RegistryUnavailableError`."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        from kvledger.schemas.registry import RegistryUnavailableError, not_found, refusal

        assert self._registry is not None
        try:
            schema = self._registry.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if not_found(exc):
                raise DecodeError(
                    "unknown_schema", f"the schema registry has no schema id {schema_id}: {exc}"
                ) from exc
            raise RegistryUnavailableError(
                f"the schema registry did not give schema id {schema_id}: {refusal(exc)}"
            ) from exc
        except Exception as exc:  # transport: refused, timed out, TLS
            raise RegistryUnavailableError(
                f"the schema registry did not answer for schema id {schema_id}: {exc!r}"
            ) from exc
        try:
            writer = fastavro.parse_schema(json.loads(schema.schema_str))
            check = _check(schema.schema_str)
        except Exception as exc:  # another type of schema (JSON, Protobuf), or none
            raise DecodeError(
                "unknown_schema", f"schema id {schema_id} is no Avro schema: {exc!r}"
            ) from exc
        self._checks[id(writer)] = check
        self._registry_writers[schema_id] = writer
        return writer


def _core_decoder() -> Decoder | None:
    """The compiled decoder; None where the extension was not built or
    KVLEDGER_PURE_AVRO=1."""
    if os.environ.get("KVLEDGER_PURE_AVRO", "") not in ("", "0"):
        return None
    return decoder()


def _check(schema_json: str) -> Program | None:
    """A writer schema's program (records as dicts), which the compiled decoder reads a
    body with to refuse malformed bytes; None where the schema is beyond it."""
    try:
        return compile_schema(json.loads(schema_json))
    except UnsupportedSchemaError:
        return None


def _compiled_programs(
    schema_json: str, decode: Decoder | None
) -> tuple[Program, Program, Decoder | None]:
    """The schema's programs for the compiled decoder (records as dicts; records as the
    codec's own types), and the decoder (None: fastavro only, when the extension was not
    built, the schema is beyond it, or KVLEDGER_PURE_AVRO=1)."""
    if decode is None:
        return (), (), None
    schema = json.loads(schema_json)
    types = {f"{NAMESPACE}.{cls.__name__}": cls for cls in (Envelope, *EVENT_CLASSES)}
    try:
        return compile_schema(schema), compile_schema(schema, types), decode
    except UnsupportedSchemaError:
        return (), (), None


def zigzag(n: int) -> bytes:
    """An Avro int or long."""
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def compiled_parts() -> dict[str, bool]:
    """Which parts of the compiled core (kvledger._core, rust/) are in use. The router index
    is the core's alone (an install without it cannot serve from memory, and says so); the
    Avro codec without it, or with KVLEDGER_PURE_AVRO=1, is fastavro's, with the same
    bytes (its decoding then lenient where the core refuses: see schemas/codec.py)."""
    import importlib.util

    core = importlib.util.find_spec("kvledger._core") is not None
    return {"router index": core, "Avro codec": Codec()._compiled is not None}
