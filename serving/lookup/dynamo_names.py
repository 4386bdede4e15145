"""Names and ids across kvledger and NVIDIA Dynamo's KV-indexer API: routing groups,
block ids, and a source's last sight as the slot table keeps it (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kvledger.consumer.core.model import SourceLife
from kvledger.serving.lookup.dynamo_requests import DEFAULT_ROUTING_GROUP

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
US = timedelta(microseconds=1)  # a µs: the slot table's unit


def group_of(routing_group: str) -> int | None:
    """kvledger's group of a Dynamo routing group (None: no such group)."""
    if routing_group == DEFAULT_ROUTING_GROUP:
        return 0
    if routing_group.isascii() and routing_group.isdigit() and len(routing_group) < 10:
        return int(routing_group)
    return None


def routing_group_of(group_idx: int) -> str:
    return DEFAULT_ROUTING_GROUP if group_idx == 0 else str(group_idx)


def seen_us(life: SourceLife | None) -> int | None:
    """A source's last sight in µs since the epoch, as the slot table keeps it (None:
    closed or unknown, never live)."""
    if life is None or life.closed_at is not None:
        return None
    return (life.last_seen - _EPOCH) // US


def block_id(key: bytes) -> int:
    """A block hash as Dynamo's u64 block id: vLLM's 8-byte hashes are that integer; longer
    digests give their last 8 bytes, as vLLM publishes them."""
    return int.from_bytes(key[-8:], "big")
