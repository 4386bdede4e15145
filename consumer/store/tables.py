"""The index's tables as the code sees them: column lists, defined once.

Each :class:`Table` lists the columns kvledger writes (with the binary COPY type of each)
and the columns an index comparison reads (``compared``: every column except wall-clock
ones, which differ between two builds of one log). The PostgreSQL store writes with the
first, ``kvledger verify`` and the store test suite compare with the second, and the memory
store produces rows in the ``compared`` order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

Column = tuple[str, str]  # (name, PostgreSQL type for binary COPY)

_RESIDENCY_KEY: tuple[Column, ...] = (
    ("model", "text"),
    ("group_idx", "int4"),
    ("block_hash", "bytea"),
    ("instance", "text"),
    ("medium", "text"),
    ("ownership", "text"),
)


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    compared: tuple[str, ...]

    @property
    def qualified(self) -> str:
        return f"kvledger.{self.name}"

    def names(self) -> str:
        return ", ".join(name for name, _ in self.columns)


GROUP_SPECS = Table(
    "group_specs",
    (
        ("model", "text"),
        ("group_idx", "int4"),
        ("kind", "text"),
        ("block_size", "int4"),
        ("hash_block_size", "int4"),
        ("sliding_window", "int4"),
        ("origin", "text"),
        ("announced_by", "text"),
    ),
    # announced_by left out: which source's announcement arrives first across partitions
    # is not fixed by the log.
    ("model", "group_idx", "kind", "block_size", "hash_block_size", "sliding_window", "origin"),
)
BLOCKS = Table(
    "blocks",
    (
        ("model", "text"),
        ("group_idx", "int4"),
        ("block_hash", "bytea"),
        ("parent_hash", "bytea"),
        ("token_start", "int8"),
        ("token_end", "int8"),
        ("token_ids", "bytea"),  # int4[] in binary (the core's BlockRows.copy_binary writes it)
        ("block_size", "int4"),
        ("partial", "bool"),
        ("lora_name", "text"),
        ("extra_keys", "text"),
        ("first_seen", "timestamptz"),
        ("last_seen", "timestamptz"),
    ),
    (
        "model",
        "group_idx",
        "block_hash",
        "parent_hash",
        "token_start",
        "token_end",
        "token_ids",
        "block_size",
        "partial",
        "lora_name",
        "extra_keys",
        "first_seen",
        "last_seen",
    ),
)
RESIDENCIES = Table(
    "residencies",
    (
        *_RESIDENCY_KEY,
        ("locality", "text"),
        ("since", "timestamptz"),
        ("kafka_topic", "text"),
        ("kafka_partition", "int4"),
        ("kafka_offset", "int8"),
        ("refcount", "int4"),
    ),
    (
        "model",
        "group_idx",
        "block_hash",
        "instance",
        "medium",
        "ownership",
        "locality",
        "since",
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "refcount",
    ),
)
RESIDENCY_HISTORY = Table(
    "residency_history",
    (
        *_RESIDENCY_KEY,
        ("locality", "text"),
        ("stored_at", "timestamptz"),
        ("removed_at", "timestamptz"),
        ("removed_by", "text"),
        ("stored_partition", "int4"),
        ("stored_offset", "int8"),
        ("closed_at", "timestamptz"),  # when the index closed it: the partition key
    ),
    (
        "model",
        "group_idx",
        "block_hash",
        "instance",
        "medium",
        "ownership",
        "locality",
        "stored_at",
        "removed_at",
        "removed_by",
        "stored_partition",
        "stored_offset",
    ),
)
# A history interval to close: the residency key, when and why.
HISTORY_CLOSE: tuple[Column, ...] = (
    *_RESIDENCY_KEY,
    ("removed_at", "timestamptz"),
    ("removed_by", "text"),
)
EVENTS = Table(
    "events",
    (
        ("kafka_topic", "text"),
        ("kafka_partition", "int4"),
        ("kafka_offset", "int8"),
        ("source", "text"),
        ("model", "text"),
        ("epoch", "int8"),
        ("seq", "int8"),
        ("event_type", "text"),
        ("group_idx", "int4"),
        ("medium", "text"),
        ("ownership", "text"),
        ("hash_count", "int4"),
        ("noop_count", "int4"),
        ("status", "text"),
        ("reason", "text"),
        ("event_time", "timestamptz"),
    ),
    (
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "source",
        "model",
        "epoch",
        "seq",
        "event_type",
        "group_idx",
        "medium",
        "ownership",
        "hash_count",
        "noop_count",
        "status",
        "reason",
        "event_time",
    ),
)
REJECTED_EVENTS = Table(
    "rejected_events",
    (
        ("kafka_topic", "text"),
        ("kafka_partition", "int4"),
        ("kafka_offset", "int8"),
        ("kafka_key", "bytea"),
        ("raw", "bytea"),
        ("reason", "text"),
        ("detail", "text"),
        ("source", "text"),
    ),
    (
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "kafka_key",
        "raw",
        "reason",
        "detail",
        "source",
    ),
)
SOURCE_HEALTH = Table(
    "source_health",
    (
        ("source", "text"),
        ("model", "text"),
        ("group_idx", "int4"),
        ("epoch", "int8"),
        ("last_seq", "int8"),
        ("gap_count", "int8"),
        ("missing_events", "int8"),
        ("epoch_changes", "int8"),
        ("duplicates", "int8"),
        ("last_event_time", "timestamptz"),
        ("surviving_media", "text[]"),
        ("lost_gaps", "int8"),
        ("lost_batches", "int8"),
        ("reports_reuse", "bool"),
    ),
    (
        "source",
        "model",
        "group_idx",
        "epoch",
        "last_seq",
        "gap_count",
        "missing_events",
        "epoch_changes",
        "duplicates",
        "last_event_time",
        "surviving_media",
        "lost_gaps",
        "lost_batches",
        "reports_reuse",
    ),
)
SOURCES = Table(
    "sources",
    (
        ("source", "text"),
        ("model", "text"),
        ("epoch", "int8"),
        ("last_seen", "timestamptz"),
        ("closed_at", "timestamptz"),
        ("heartbeat_ms", "int8"),
        ("restarts", "int8"),
        ("requests_running", "int4"),
        ("requests_waiting", "int4"),
        ("load_at", "timestamptz"),
    ),
    (
        "source",
        "model",
        "epoch",
        "last_seen",
        "closed_at",
        "heartbeat_ms",
        "restarts",
        "requests_running",
        "requests_waiting",
        "load_at",
    ),
)
LIFECYCLE_EVENTS = Table(
    "lifecycle_events",
    (
        ("source", "text"),
        ("model", "text"),
        ("group_idx", "int4"),
        ("kind", "text"),
        ("epoch", "int8"),
        ("previous_epoch", "int8"),
        ("event_time", "timestamptz"),
        ("kafka_topic", "text"),
        ("kafka_partition", "int4"),
        ("kafka_offset", "int8"),
        ("ended_gpu", "int4"),
        ("ended_cpu", "int4"),
        ("ended_storage", "int4"),
        ("first_lost_seq", "int8"),
        ("last_lost_seq", "int8"),
    ),
    (
        "source",
        "model",
        "group_idx",
        "kind",
        "epoch",
        "previous_epoch",
        "event_time",
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "ended_gpu",
        "ended_cpu",
        "ended_storage",
        "first_lost_seq",
        "last_lost_seq",
    ),
)

# The tables an index comparison covers, in the order it reports them.
COMPARED: Mapping[str, Table] = {
    t.name: t
    for t in (
        GROUP_SPECS,
        BLOCKS,
        RESIDENCIES,
        RESIDENCY_HISTORY,
        EVENTS,
        REJECTED_EVENTS,
        SOURCE_HEALTH,
        SOURCES,
        LIFECYCLE_EVENTS,
    )
}
