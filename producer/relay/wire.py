"""vLLM's KV event batches as they travel on its ZMQ stream (pure; no sockets).

A batch is a msgpack array ``[ts, events, data_parallel_rank]`` (the rank may be absent).
Each event is either a map whose first key is ``"type"`` (vLLM 0.33.0 and later) or a
positional array whose first item is the type name (older engines); either way its fields
follow vLLM's declaration order and fields left at their defaults may be absent. The frames
around it: ``[topic, seq (8 bytes big-endian), payload]``; the replay socket's end marker has
the seq of eight 0xff bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvledger.producer.vllm import (
    FIELDS,
    VllmEventError,
    from_vllm_event,
    from_vllm_fields,
    register_kind,
)
from kvledger.schemas.events import AllBlocksCleared, KVEvent

END_SEQ = b"\xff" * 8
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One decoded batch: the engine's time (seconds), its events, its rank if it said.

    From :func:`decode_batch`, the events are kvledger's; from :func:`read_batch`, vLLM's
    (for a publisher's ``prepare_vllm``)."""

    ts: float
    events: list[Any]
    dp_rank: int | None


def starts_cleared(batch: EngineBatch | None) -> bool:
    """Whether ``batch`` (as :func:`read_batch` reads it) starts with ``AllBlocksCleared``."""
    if batch is None or not batch.events:
        return False
    return isinstance(batch.events[0], _Cleared | AllBlocksCleared)


def seq_of(frame: bytes) -> int:
    """A sequence-number frame (8 bytes, big-endian) as an int; one past the int64 range
    the contract carries (``engine_seq``) is refused, as a malformed frame is."""
    if len(frame) != 8:
        raise VllmEventError(f"a sequence frame has 8 bytes, not {len(frame)}")
    seq = int.from_bytes(frame, "big")
    if seq >= 1 << 63:
        raise VllmEventError(f"a sequence number past int64: {seq}")
    return seq


def decode_batch(payload: bytes) -> EngineBatch:
    """Decode one batch payload into kvledger's events; raises :class:`VllmEventError` with
    the reason."""
    batch = read_batch(payload)
    events = [e if isinstance(e, KVEvent) else from_vllm_event(e) for e in batch.events]
    return EngineBatch(batch.ts, events, batch.dp_rank)


def read_batch(payload: bytes) -> EngineBatch:
    """Decode one batch payload, its events still vLLM's: decoded structs with vLLM's
    names, or kvledger events where the payload had to be read field by field. Raises
    :class:`VllmEventError` for a payload that is no batch; what an event's fields hold is
    checked as it is mapped (a publisher's ``prepare_vllm``, :func:`decode_batch`).

    The typed decoders (msgspec validates in C) read a well-formed batch in either encoding;
    anything they refuse is read again field by field, which accepts what they cannot
    express and says precisely what is wrong with the rest."""
    try:
        for decoder in (_TAGGED, _POSITIONAL):
            try:
                typed = decoder.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            return checked(EngineBatch(typed.ts, typed.events, typed.data_parallel_rank))
        return checked(_decode_fields(payload))
    except RecursionError:
        raise VllmEventError(TOO_DEEP) from None


# What any engine's batch must hold before it reaches the encoder: a time whose
# milliseconds an Avro long carries with room (any clock's reading, NaN and the infinities
# not), and a rank the envelope's int carries.
MAX_TS_S = 1e12
TOO_DEEP = "the payload nests deeper than any engine's batch does"


def checked(batch: EngineBatch) -> EngineBatch:
    """``batch`` when its time and rank are ones the contract carries; else
    :class:`VllmEventError` with the reason (every engine's reader ends with it)."""
    ts, rank = batch.ts, batch.dp_rank
    if not -MAX_TS_S <= ts <= MAX_TS_S:  # False for NaN too
        raise VllmEventError(f"the batch's ts {ts!r} is not a time in seconds")
    if rank is not None and not 0 <= rank < 1 << 31:
        raise VllmEventError(f"the batch's data-parallel rank {rank} is out of range")
    return batch


def _decode_fields(payload: bytes) -> EngineBatch:
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise VllmEventError(f"the payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise VllmEventError("a batch is an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise VllmEventError(f"the batch's ts is not a number: {ts!r}")
    if not isinstance(events, list):
        raise VllmEventError("the batch's events are not an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise VllmEventError(f"the batch's data_parallel_rank is not an int: {rank!r}")
    return EngineBatch(float(ts), [decode_event(e) for e in events], rank)


def decode_event(raw: Any) -> KVEvent:
    """One event, tagged map or positional array."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise VllmEventError("an event map without a string 'type'")
        fields = {k: v for k, v in raw.items() if k != "type"}
        return from_vllm_fields(kind, fields)
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = FIELDS.get(kind)
        if names is None:
            raise VllmEventError(f"unknown vLLM event type {kind!r}")
        values = raw[1:]
        if len(values) > len(names):
            raise VllmEventError(f"{kind} has {len(values)} fields, vLLM defines {len(names)}")
        return from_vllm_fields(kind, dict(zip(names, values, strict=False)))
    raise VllmEventError(f"an event is a map or a tagged array, not {type(raw).__name__}")


# ---------------------------------------------------------------------- typed decoding
# vLLM's event structs as msgspec types (vLLM 0.33.0's fields and order; the fields older
# engines lack take defaults). Tagged maps carry the type under "type"; positional arrays
# carry it first.
class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _StoredArray(_Stored, array_like=True):
    pass


class _RemovedArray(_Removed, array_like=True):
    pass


class _ClearedArray(_Cleared, array_like=True):
    pass


class _TaggedBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


class _PositionalBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: int | None = None


_TAGGED = msgspec.msgpack.Decoder(_TaggedBatch)
_POSITIONAL = msgspec.msgpack.Decoder(_PositionalBatch)


for _kind, _classes in (
    ("BlockStored", (_Stored, _StoredArray)),
    ("BlockRemoved", (_Removed, _RemovedArray)),
    ("AllBlocksCleared", (_Cleared, _ClearedArray)),
):
    for _cls in _classes:
        register_kind(_cls, _kind)
