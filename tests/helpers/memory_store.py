"""The in-memory store: the same index as the PostgreSQL store, in Python dictionaries.

The tests' second store and oracle: it applies the plans the pure core makes exactly as
the PostgreSQL store merges them (the conformance suite, tests/test_conformance.py, runs
one stream through both and compares :meth:`MemoryStore.dump` with ``verify.dump``), and
the planner's unit tests read its dictionaries. Writes are staged and applied when the
transaction exits normally; a failed transaction changes nothing. One writer at a time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from kvledger.consumer.core.audit import replay_reason
from kvledger.consumer.core.compact import upgrades
from kvledger.consumer.core.model import (
    AuditRow,
    BlockKey,
    BlockRow,
    BlockWrite,
    GroupKey,
    HeldSpec,
    HolderKey,
    LifecycleEvent,
    Needs,
    Plan,
    Rejection,
    Residency,
    ResidencyKey,
    Snapshot,
    SourceKey,
    SourceLife,
    SourceState,
)
from kvledger.consumer.store.staged import StagedStore
from kvledger.schemas.events import DEFAULT_MEDIUM, GroupSpec

Coordinates = tuple[str, int, int]  # (topic, partition, offset)


@dataclass(slots=True)
class _BlockMeta:
    lora_name: str | None
    extra_keys: str | None
    first_seen: datetime
    last_seen: datetime


@dataclass(slots=True)
class _HistoryRow:
    key: ResidencyKey
    locality: str | None
    stored_at: datetime
    removed_at: datetime | None
    removed_by: str | None
    partition: int
    offset: int


class MemoryStore(StagedStore):
    """The index in memory (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: dict[GroupKey, HeldSpec] = {}
        self.announced_by: dict[GroupKey, str | None] = {}
        self.blocks: dict[BlockKey, BlockRow] = {}
        self.block_meta: dict[BlockKey, _BlockMeta] = {}
        self.residencies: dict[ResidencyKey, Residency] = {}
        self.held: dict[HolderKey, set[bytes]] = {}
        self.history: list[_HistoryRow] = []
        self.open_history: dict[ResidencyKey, _HistoryRow] = {}
        self.sources: dict[SourceKey, SourceState] = {}
        self.lives: dict[str, SourceLife] = {}
        self.lifecycle: list[LifecycleEvent] = []
        self.events: dict[Coordinates, AuditRow] = {}
        self.rejected: dict[Coordinates, tuple[Rejection, bool]] = {}  # (rejection, replayed)

    # ------------------------------------------------------------------ the interface
    def load(self, needs: Needs) -> Snapshot:
        # The committed state itself: the core never mutates a snapshot, and this
        # transaction's writes are staged until it ends.
        late = []
        for holder, topic, partition, offset in needs.replayed:
            model, group, source, medium, ownership = holder
            if any(
                (row.kafka_topic, row.kafka_partition) == (topic, partition)
                and row.kafka_offset > offset and row.event_type == "BlockRemoved"
                and row.noop_count > 0 and row.source == source and row.model == model
                and row.group_idx == group and (row.medium or DEFAULT_MEDIUM) == medium
                and (row.ownership or "") == ownership
                for row in self.events.values()
            ):  # fmt: skip
                late.append((topic, partition, offset))
        return Snapshot(
            self.specs, self.blocks, self.residencies, self.held, self.sources, self.lives, late
        )

    def declare(self, spec: GroupSpec) -> None:
        """An operator's spec (wins over announcements), as ``kvledger groups declare``."""
        key = GroupKey(spec.model, spec.group_idx)
        self.specs[key] = HeldSpec(spec, "declared")
        self.announced_by[key] = None

    # ------------------------------------------------------------------ applying a plan
    def _apply(self, plan: Plan) -> None:
        for spec, by in plan.new_specs:
            key = GroupKey(spec.model, spec.group_idx)
            if key not in self.specs:
                self.specs[key] = HeldSpec(spec, "announced")
                self.announced_by[key] = by
        for bkey, write in plan.blocks.items():
            self._merge_block(bkey, write)
        self._apply_residencies(plan)
        self.sources.update(plan.sources)
        self.lives.update(plan.lives)
        self.lifecycle.extend(plan.lifecycle)
        if plan.replay:
            for row in plan.audit:
                if row.status != "applied":
                    continue
                at = (row.kafka_topic, row.kafka_partition, row.kafka_offset)
                old = self.events.get(at)
                if old is not None:
                    self.events[at] = old._replace(
                        status="applied", reason=replay_reason(row.reason),
                        hash_count=row.hash_count, noop_count=row.noop_count,
                    )  # fmt: skip
                if at in self.rejected:
                    self.rejected[at] = (self.rejected[at][0], True)
        else:
            for row in plan.audit:
                self.events[(row.kafka_topic, row.kafka_partition, row.kafka_offset)] = row
            for r in plan.rejected:
                m = r.message
                self.rejected.setdefault((m.topic, m.partition, m.offset), (r, False))

    def _merge_block(self, key: BlockKey, write: BlockWrite) -> None:
        known = self.blocks.get(key)
        meta = self.block_meta.get(key)
        if known is None or meta is None:
            self.blocks[key] = write.row
            self.block_meta[key] = _BlockMeta(
                write.lora_name, write.extra_keys, write.first_seen, write.last_seen
            )
            return
        if upgrades(known, write.row):
            self.blocks[key] = write.row
        if meta.lora_name is None:
            meta.lora_name = write.lora_name
        if meta.extra_keys is None:
            meta.extra_keys = write.extra_keys
        meta.first_seen = min(meta.first_seen, write.first_seen)
        meta.last_seen = max(meta.last_seen, write.last_seen)

    def _apply_residencies(self, plan: Plan) -> None:
        deltas = plan.residencies  # made from the plan's compact residencies at each read
        for d in deltas:
            key = d.key
            if d.close_existing_at is not None:
                row = self.open_history.pop(key, None)
                if row is not None:
                    row.removed_at = max(d.close_existing_at, row.stored_at)
                    row.removed_by = d.close_existing_by
        for d in deltas:
            key = d.key
            for i in d.intervals:
                row = _HistoryRow(
                    key, i.locality, i.stored_at, i.removed_at, i.removed_by, i.partition, i.offset
                )
                self.history.append(row)
                if i.removed_at is None:
                    self.open_history[key] = row
            holder = key.holder
            if d.refcount > 0:
                assert d.since is not None
                self.residencies[key] = Residency(
                    d.refcount, d.locality, d.since, d.topic, d.partition, d.offset
                )
                self.held.setdefault(holder, set()).add(key.block_hash)
            elif key in self.residencies:
                del self.residencies[key]
                hashes = self.held.get(holder)
                if hashes is not None:
                    hashes.discard(key.block_hash)
                    if not hashes:
                        del self.held[holder]

    # ------------------------------------------------------------------ comparison
    def dump(self) -> dict[str, Counter[tuple[object, ...]]]:
        """Every table as a multiset of rows, as ``verify.dump`` reads PostgreSQL's."""
        out: dict[str, Counter[tuple[object, ...]]] = {}
        out["group_specs"] = Counter(
            (k.model, k.group_idx, h.spec.kind, h.spec.block_size, h.spec.hash_block_size,
             h.spec.sliding_window, h.origin)
            for k, h in self.specs.items()
        )  # fmt: skip
        out["blocks"] = Counter(
            (*k, r.parent_hash, r.token_start, r.token_end, r.token_ids, r.block_size,
             r.partial, m.lora_name, m.extra_keys, m.first_seen, m.last_seen)
            for k, r in self.blocks.items()
            for m in (self.block_meta[k],)
        )  # fmt: skip
        out["residencies"] = Counter(
            (*k, r.locality, r.since, r.topic, r.partition, r.offset, r.refcount)
            for k, r in self.residencies.items()
        )
        out["residency_history"] = Counter(
            (*h.key, h.locality, h.stored_at, h.removed_at, h.removed_by, h.partition, h.offset)
            for h in self.history
        )
        out["events"] = Counter(tuple(row) for row in self.events.values())
        out["rejected_events"] = Counter(
            (r.message.topic, r.message.partition, r.message.offset, r.message.key,
             r.message.value, r.reason, r.detail, r.source)
            for r, _ in self.rejected.values()
        )  # fmt: skip
        out["source_health"] = Counter(
            (*k, s.epoch, s.last_seq, s.gap_count, s.missing_events, s.epoch_changes,
             s.duplicates, s.last_event_time, s.surviving_media, s.lost_gaps, s.lost_batches,
             s.reports_reuse)
            for k, s in self.sources.items()
        )  # fmt: skip
        out["sources"] = Counter(
            (source, life.model, life.epoch, life.last_seen, life.closed_at, life.heartbeat_ms,
             life.restarts, life.requests_running, life.requests_waiting, life.load_at)
            for source, life in self.lives.items()
        )  # fmt: skip
        out["lifecycle_events"] = Counter(
            (e.source, e.model, e.group_idx, e.kind, e.epoch, e.previous_epoch, e.event_time,
             e.kafka_topic, e.kafka_partition, e.kafka_offset, e.ended_gpu, e.ended_cpu,
             e.ended_storage, e.first_lost_seq, e.last_lost_seq)
            for e in self.lifecycle
        )  # fmt: skip
        return out
