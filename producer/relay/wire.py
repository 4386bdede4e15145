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

from kvledger.producer.vllm import FIELDS, VllmEventError, from_vllm_fields
from kvledger.schemas.events import KVEvent

END_SEQ = b"\xff" * 8
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One decoded batch: the engine's time (seconds), its events, its rank if it said."""

    ts: float
    events: list[KVEvent]
    dp_rank: int | None


def seq_of(frame: bytes) -> int:
    """A sequence-number frame (8 bytes, big-endian) as an int."""
    if len(frame) != 8:
        raise VllmEventError(f"a sequence frame has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_batch(payload: bytes) -> EngineBatch:
    """Decode one batch payload; raises :class:`VllmEventError` with the reason."""
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
