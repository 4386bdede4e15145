"""Messages as the consumer sees them, and their decoding (pure: bytes in, values out)."""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

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


def from_kafka(m: Message) -> Inbound:
    """A consumed Kafka message as the pipeline takes it (coordinates, bytes, log time)."""
    topic, partition, offset = m.topic(), m.partition(), m.offset()
    assert topic is not None and partition is not None and offset is not None
    kind, timestamp = m.timestamp()
    log_time = timestamp if kind != TIMESTAMP_NOT_AVAILABLE else None
    return Inbound(topic, partition, offset, m.key(), m.value() or b"", log_time)


@dataclass(frozen=True, slots=True)
class Decoded:
    message: Inbound
    envelope: Envelope | None
    error: DecodeError | None


def decode(message: Inbound, codec: Codec) -> Decoded:
    """Decode one message; a failure becomes a value, never an exception (but for a schema
    registry that does not answer: the message is not at fault, and the caller waits)."""
    try:
        return Decoded(message, codec.decode(message.value), None)
    except DecodeError as exc:
        return Decoded(message, None, exc)
