"""Routing decisions on the wire: what a replica of the lookup service writes to the
decisions topic, and what the other replicas and the recorder read back.

A replica that takes a decision report holds it at once (the read side's
``serving.router.provisional.Provisional``) and writes it here; every replica reads the
topic from the start of the provisional window and holds the decisions the others took. The
topic is a hint channel, not a log of record: a decision lost on the way costs one lookup's
freshness, never the index's truth, so it is written without transactions and read without a
consumer group. A record that does not read as a decision is skipped, counted and logged
with its partition and offset.

The wire form is JSON: ``{"v": 1, "model", "group_idx", "instance", "kind": "tokens" |
"hashes", "keys": [u64...], "origin", "request_id"?}``; the keys are the prompt's chained
block keys (``serving.router.provisional.token_keys``), never its tokens. Version 2 adds
``record`` (:class:`Record`): what the index offered when the decision was taken, which the consumer
keeps in PostgreSQL (consumer/decision_records.py) for the funnel of available, captured
and delivered reuse. Version 3 is an answer no router reported a choice for (Dynamo's
``/query``): ``{"v": 3, "model", "group_idx", "origin", "record"}``, recorded for the funnel,
never held. Replicas read every version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

MAX_RECORD_BYTES = 512 * 1024
_U64 = (1 << 64) - 1

Kind = Literal["tokens", "hashes"]
TOKENS: Kind = "tokens"
HASHES: Kind = "hashes"


@dataclass(frozen=True, slots=True)
class Decision:
    """A router sent the prompt keyed ``keys`` (of ``kind`` tokens or hashes) to
    ``instance``; ``origin``: the service that took the report (replicas skip their own)."""

    model: str
    group_idx: int
    instance: str
    kind: Kind
    keys: tuple[int, ...]
    origin: str = ""
    request_id: str | None = None


_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
_Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
_Hex = Annotated[str, msgspec.Meta(min_length=2, max_length=128, pattern="^([0-9a-f]{2})+$")]


class Offer(msgspec.Struct, forbid_unknown_fields=True):
    """One holder the index answered for the prompt: its leading blocks on one tier."""

    instance: _Name
    medium: Annotated[str, msgspec.Meta(max_length=64)]
    ownership: Annotated[str, msgspec.Meta(max_length=512)]
    blocks: _Count
    state: Annotated[str, msgspec.Meta(max_length=16)]


class Record(msgspec.Struct, forbid_unknown_fields=True):
    """A decision as data: its id and time, the prompt's identity (its length in blocks and,
    when it was reported by block hashes, the hashes), what the index offered and what the
    chosen instance had. *Available*: the most leading blocks any live holder had;
    *captured*: what the chosen instance had (on its best tier)."""

    id: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    at: Annotated[float, msgspec.Meta(ge=0, lt=1e11)]  # seconds since the epoch
    block_size: Annotated[int, msgspec.Meta(gt=0, lt=1 << 31)]
    prompt_blocks: _Count
    available_blocks: _Count
    silent_blocks: _Count
    offered: Annotated[list[Offer], msgspec.Meta(max_length=1024)]
    # The chosen instance's state and blocks: None in an answer no choice was reported for.
    chosen_state: Annotated[str, msgspec.Meta(max_length=16)] | None = None
    captured_blocks: _Count | None = None
    available_tier: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    captured_tier: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    captured_hashes: Annotated[list[_Hex], msgspec.Meta(max_length=65_536)] | None = None
    first_hash: _Hex | None = None  # the prompt's, when reported by hashes
    last_hash: _Hex | None = None


@dataclass(frozen=True, slots=True)
class Answered:
    """An answer the service gave (Dynamo's ``/query``) for which no router reported the
    instance it chose: recorded with what was offered, never held."""

    model: str
    group_idx: int
    origin: str = ""
    request_id: str | None = None


class _Wire(msgspec.Struct, forbid_unknown_fields=True):
    v: Literal[1, 2, 3]
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    group_idx: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    origin: Annotated[str, msgspec.Meta(max_length=64)]
    instance: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    kind: Literal["tokens", "hashes"] | None = None
    keys: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=65_536)] = []
    request_id: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    record: Record | None = None


_decode = msgspec.json.Decoder(_Wire).decode
_encode = msgspec.json.Encoder().encode


def encode(d: Decision | Answered, record: Record | None = None) -> bytes:
    if isinstance(d, Answered):
        if record is None:
            raise ValueError("an answer is recorded with what it offered")
        return _encode(
            _Wire(3, d.model, d.group_idx, d.origin, request_id=d.request_id, record=record)
        )
    return _encode(
        _Wire(
            1 if record is None else 2,
            d.model,
            d.group_idx,
            d.origin,
            d.instance,
            d.kind,
            list(d.keys),
            d.request_id,
            record,
        )
    )


def decode(raw: bytes) -> Decision | Answered:
    """A record's decision (or answer); ``ValueError`` saying why it is neither."""
    return decode_record(raw)[0]


def decode_record(raw: bytes) -> tuple[Decision | Answered, Record | None]:
    """A record's decision (or, version 3, answer) and, from version 2, what was offered;
    ``ValueError`` saying why it is not one."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        w = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(str(exc)) from None
    if (w.v == 1) != (w.record is None):
        raise ValueError(f"v {w.v} with{'out' if w.record is None else ''} a record")
    if w.v == 3:
        if w.instance is not None or w.kind is not None or w.keys:
            raise ValueError("v 3 (an answer) names no instance, kind or keys")
        if w.record is not None and (
            w.record.chosen_state is not None or w.record.captured_blocks is not None
        ):
            raise ValueError("v 3 (an answer) has no chosen_state or captured_blocks")
        return Answered(w.model, w.group_idx, w.origin, w.request_id), w.record
    if w.instance is None or w.kind is None:
        raise ValueError(f"v {w.v} without {'instance' if w.instance is None else 'kind'}")
    if w.record is not None and (w.record.chosen_state is None or w.record.captured_blocks is None):
        raise ValueError(f"v {w.v} without the record's chosen_state or captured_blocks")
    if w.keys and max(w.keys) > _U64:
        raise ValueError("a key over 2^64-1")
    decision = Decision(
        w.model, w.group_idx, w.instance, w.kind, tuple(w.keys), w.origin, w.request_id
    )
    return decision, w.record
