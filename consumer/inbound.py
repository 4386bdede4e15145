"""Messages as the consumer sees them, and their decoding (pure: bytes in, values out)."""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import Envelope


@dataclass(frozen=True, slots=True)
class Inbound:
    """One Kafka message's coordinates and bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    # The record's log time in ms (the broker's append time on a LogAppendTime topic, else
    # the producer's create time); None when the client had none.
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Decoded:
    message: Inbound
    envelope: Envelope | None
    error: DecodeError | None


def decode(message: Inbound, codec: Codec) -> Decoded:
    """Decode one message; a failure becomes a value, never an exception."""
    try:
        return Decoded(message, codec.decode(message.value), None)
    except DecodeError as exc:
        return Decoded(message, None, exc)
