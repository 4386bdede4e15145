"""The values the pure core reads and writes: keys, the state a batch touches, and the plan.

Nothing here does I/O. A store loads a :class:`Snapshot` for the :class:`Needs` of a batch;
:func:`~kvledger.consumer.core.plan.make_plan` turns the batch and the snapshot into a
:class:`Plan`; the store writes the plan. Snapshot values are never mutated by the core.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple

from kvledger.consumer.inbound import Inbound
from kvledger.schemas.events import GroupSpec

if TYPE_CHECKING:
    from kvledger.consumer.core.compact import BlockRows, Residencies

PRIMARY_OWNERSHIP = ""  # the ownership column's value for events without one
# A named tuple from its values, without its generated __new__ (the planner's per-hash keys).
new_tuple = tuple.__new__


class GroupKey(NamedTuple):
    model: str
    group_idx: int


class BlockKey(NamedTuple):
    model: str
    group_idx: int
    block_hash: bytes


class HolderKey(NamedTuple):
    """Who holds blocks of one group: an instance (source), on a medium, with an ownership."""

    model: str
    group_idx: int
    instance: str
    medium: str
    ownership: str


class ResidencyKey(NamedTuple):
    """One block held by one holder (the residencies table's primary key, in its order)."""

    model: str
    group_idx: int
    block_hash: bytes
    instance: str
    medium: str
    ownership: str

    @property
    def holder(self) -> HolderKey:
        return HolderKey(self.model, self.group_idx, self.instance, self.medium, self.ownership)


class SourceKey(NamedTuple):
    """A source's sequence stream: sequence numbers count per (source, model, group)."""

    source: str
    model: str
    group_idx: int


@dataclass(frozen=True, slots=True)
class HeldSpec:
    """A group spec as the index holds it: the contract's shape and who set it."""

    spec: GroupSpec
    origin: str  # declared | announced


class BlockRow(NamedTuple):
    """What the index knows of one block hash's content (for conflict checks). A named
    tuple, as the keys are: the planner makes one per hash of every event."""

    parent_hash: bytes | None
    token_start: int | None
    token_ids: tuple[int, ...]
    block_size: int
    partial: bool

    @property
    def placeholder(self) -> bool:
        return self.block_size == 0

    @property
    def token_end(self) -> int | None:
        if self.token_start is None:
            return None
        return self.token_start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Residency:
    """A live residency: its reference count and the message that opened it."""

    refcount: int
    locality: str | None
    since: datetime
    topic: str
    partition: int
    offset: int


@dataclass(slots=True)
class SourceState:
    """A source stream's sequence position and counters (the source_health row)."""

    epoch: int
    last_seq: int
    gap_count: int = 0
    missing_events: int = 0
    epoch_changes: int = 0
    duplicates: int = 0
    last_event_time: datetime | None = None
    # What the source said outlives its restart (GroupSpec.surviving_media); None: default.
    surviving_media: tuple[str, ...] | None = None
    # Gaps a relay could not recover from its engine (EventsLost), and the batches lost.
    lost_gaps: int = 0
    lost_batches: int = 0
    # Whether the source re-announces reused blocks as stores (GroupSpec.reports_reuse).
    reports_reuse: bool = False

    def copy(self) -> SourceState:
        return SourceState(
            self.epoch,
            self.last_seq,
            self.gap_count,
            self.missing_events,
            self.epoch_changes,
            self.duplicates,
            self.last_event_time,
            self.surviving_media,
            self.lost_gaps,
            self.lost_batches,
            self.reports_reuse,
        )


@dataclass(frozen=True, slots=True)
class SourceLife:
    """One source's life as the index follows it (the sources row).

    ``last_seen`` is the log time of its latest message (the broker's append time on a topic
    with LogAppendTime, else the producer's create time); ``closed_at`` is set by a goodbye
    and cleared by any later message. ``requests_running``/``requests_waiting`` are the
    engine's load as its latest heartbeat that carried one said, at ``load_at`` (its log
    time); a restart, a goodbye or another model ends them.
    """

    model: str
    epoch: int
    last_seen: datetime
    closed_at: datetime | None = None
    heartbeat_ms: int | None = None
    restarts: int = 0
    # The model the source spoke before its latest change of model, and when (None: it
    # never changed): one source id reused for another model is a configuration mistake
    # that `kvledger sources` shows.
    previous_model: str | None = None
    model_changed_at: datetime | None = None
    requests_running: int | None = None
    requests_waiting: int | None = None
    load_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class ModelChange:
    """A source that spoke of one model and then of another (logged as a warning)."""

    source: str
    previous: str
    model: str
    at: datetime


@dataclass(frozen=True, slots=True)
class HolderScope:
    """Every block of an instance in one group or (None) all, on one medium and ownership
    or (None) any."""

    model: str
    group_idx: int | None
    instance: str
    medium: str | None
    ownership: str | None

    def covers(self, holder: HolderKey) -> bool:
        return (
            holder.model == self.model
            and holder.instance == self.instance
            and (self.group_idx is None or holder.group_idx == self.group_idx)
            and (self.medium is None or holder.medium == self.medium)
            and (self.ownership is None or holder.ownership == self.ownership)
        )


@dataclass(slots=True)
class Needs:
    """What a batch touches, for the store to load (see :func:`plan.needs`).

    ``restarts``: each source stream's newest epoch in the batch; the store loads every
    residency of the streams whose stored epoch is older (the restart rule ends them).
    """

    blocks: dict[GroupKey, set[bytes]] = field(default_factory=dict)
    residencies: dict[HolderKey, set[bytes]] = field(default_factory=dict)
    scopes: set[HolderScope] = field(default_factory=set)
    restarts: dict[SourceKey, int] = field(default_factory=dict)
    sources: set[str] = field(default_factory=set)
    # A replay's stores: (holder, topic, partition, offset) of each, for ``late_removals``.
    replayed: list[tuple[HolderKey, str, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class Snapshot:
    """The state a batch touches, as the store held it before the batch.

    ``residencies`` holds at least every live residency named in ``Needs.residencies``;
    ``held`` maps each holder in a ``Needs.scopes`` entry or in a restarting stream to all
    of its live hashes (their residencies are in ``residencies`` too). A store may hand over
    more than was asked (the memory store hands over everything).
    """

    specs: Mapping[GroupKey, HeldSpec]
    blocks: Mapping[BlockKey, BlockRow]
    residencies: Mapping[ResidencyKey, Residency]
    held: Mapping[HolderKey, Collection[bytes]]
    sources: Mapping[SourceKey, SourceState]
    lives: Mapping[str, SourceLife]
    # Of a replay's stores (``Needs.replayed``), the (topic, partition, offset) of those whose
    # holder has recorded a removal with no reference left after them (see plan.py).
    late_removals: Collection[tuple[str, int, int]] = ()
    # Whether the store keeps the residency history and the audit log: a store that keeps
    # neither (the router's) is spared their intervals and rows; every rule is the same.
    history: bool = True
    # The block rows and residencies of the batch written before this one commits (planning
    # ahead): they read over ``blocks``, ``residencies`` and ``held``, as the store will
    # hold them.
    block_base: BlockRows | None = None
    residency_base: Residencies | None = None


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True, slots=True)
class Rejection:
    """A poison message: its coordinates, raw bytes and why (for the DLQ and the table)."""

    message: Inbound
    reason: str
    detail: str
    source: str | None


@dataclass(slots=True)
class BlockWrite:
    """A block row to merge: content (upgraded only over placeholders and partial tails),
    metadata kept from the first writer, and the times it was seen in this batch.
    ``stored``: the snapshot held a row for the block (False: the store had none when the
    batch was planned, so it may be inserted as it is, unless another writer stored one
    since)."""

    row: BlockRow
    lora_name: str | None
    extra_keys: str | None
    first_seen: datetime
    last_seen: datetime
    stored: bool = True


@dataclass(slots=True)
class Interval:
    """A residency history interval opened by this batch (closed too, when it ended)."""

    stored_at: datetime
    locality: str | None
    partition: int
    offset: int
    removed_at: datetime | None = None
    removed_by: str | None = None


@dataclass(slots=True)
class ResidencyDelta:
    """How one residency changed in the batch.

    ``before`` and ``refcount`` are the reference counts at the batch's start and end; a
    0→1 transition opens an :class:`Interval`, a 1→0 transition closes it, or (when the
    interval was opened by an earlier batch) sets ``close_existing_at``. ``existed`` says
    whether the store held the row at the batch's start (so a 0 at the end deletes it).
    """

    key: ResidencyKey
    before: int
    refcount: int
    existed: bool
    locality: str | None = None
    since: datetime | None = None
    topic: str = ""
    partition: int = 0
    offset: int = 0
    close_existing_at: datetime | None = None
    close_existing_by: str | None = None
    intervals: list[Interval] = field(default_factory=list)
    touched: bool = False


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """A source stream restarted (a new epoch), said goodbye, or lost engine batches its
    relay could not recover (``lost``, with their range), and what ended with it."""

    source: str
    model: str
    group_idx: int | None  # None: a goodbye, for every group
    kind: str  # restart | closed | lost
    epoch: int
    previous_epoch: int | None
    event_time: datetime
    kafka_topic: str
    kafka_partition: int
    kafka_offset: int
    ended_gpu: int
    ended_cpu: int
    ended_storage: int
    first_lost_seq: int | None = None
    last_lost_seq: int | None = None


class AuditRow(NamedTuple):
    """One row of the audit log (kvledger.events), one per message, in its column order."""

    kafka_topic: str
    kafka_partition: int
    kafka_offset: int
    source: str | None
    model: str | None
    epoch: int | None
    seq: int | None
    event_type: str | None
    group_idx: int | None
    medium: str | None
    ownership: str | None
    hash_count: int
    noop_count: int
    status: str  # applied | duplicate | rejected
    reason: str | None
    event_time: datetime | None


@dataclass(slots=True)
class Plan:
    """Everything one batch changes, for a store to write in one transaction.

    ``replay`` plans come from re-applying rejected messages: no sequence checks, and the
    audit rows update the existing ones instead of being inserted.
    """

    replay: bool = False
    new_specs: list[tuple[GroupSpec, str]] = field(default_factory=list)  # (spec, announced_by)
    rows: BlockRows | None = None  # the block rows to merge, compact (None: none)
    refs: Residencies | None = None  # the residencies changed, compact (None: none)
    sources: dict[SourceKey, SourceState] = field(default_factory=dict)
    lives: dict[str, SourceLife] = field(default_factory=dict)
    model_changes: list[ModelChange] = field(default_factory=list)
    lifecycle: list[LifecycleEvent] = field(default_factory=list)
    audit: list[AuditRow] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    messages: int = 0
    applied: int = 0
    duplicates: int = 0
    block_events: int = 0  # hashes applied (stores + removals)
    noop_removals: int = 0
    reported_reuse: int = 0  # stored blocks a reuse-reporting source already held
    gaps: int = 0

    @property
    def blocks(self) -> dict[BlockKey, BlockWrite]:
        """The block rows to merge as objects, for a store that merges them one by one (the
        PostgreSQL store copies ``rows`` as they are)."""
        from kvledger.consumer.core.compact import block_writes  # it reads this module's types

        return block_writes(self.rows) if self.rows is not None else {}

    @property
    def residencies(self) -> list[ResidencyDelta]:
        """The residencies changed, as objects, for a store that applies them one by one
        (the PostgreSQL store copies ``refs`` as they are)."""
        from kvledger.consumer.core.compact import residency_deltas

        return residency_deltas(self.refs) if self.refs is not None else []

    @property
    def replayed(self) -> int:
        """Messages a replay plan applied (its audit rows that are not rejections)."""
        return sum(1 for row in self.audit if row.status == "applied") if self.replay else 0
