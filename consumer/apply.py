"""Apply a batch of decoded messages to the PostgreSQL index in the caller's transaction.

Order of work for one batch (all inside ONE transaction, committed by the caller together
with the consumer offsets written here):

1. fence: lock this group's offset rows for the batch's partitions and check that each
   partition's stored next offset is the batch's first offset (else another consumer owns it);
2. preload what the batch touches: group specs, known blocks, residency reference counts,
   source sequence state;
3. walk the messages in order in memory: sequence checks (duplicates, stale epochs, gaps),
   validation, reference counting, history intervals; collapse repeated keys;
4. write everything with a few bulk statements (COPY into temp tables, then merge);
5. write the offsets.

Rejected messages are returned as :class:`Rejection` values for the dead-letter path.
"""

from __future__ import annotations

import logging
import struct
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg

from consumer.inbound import Decoded, Inbound
from consumer.validate import (
    BlockRow,
    Invalid,
    Reason,
    Spec,
    check_announcement,
    check_cleared,
    check_removed,
    check_stored,
    conflicts,
    explode,
)
from schemas.errors import KvledgerError
from schemas.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    GroupSpec,
)

logger = logging.getLogger(__name__)

GroupKey = tuple[str, int]  # (model, group_idx)
BlockKey = tuple[str, int, bytes]
HolderKey = tuple[str, int, str, str, str]  # (model, group, instance, medium, ownership)
ResKey = tuple[str, int, bytes, str, str, str]


class FencedError(KvledgerError):
    """Another consumer advanced a partition of this batch: the batch must be abandoned."""

    def __init__(self, partitions: dict[int, tuple[int, int]]) -> None:
        detail = ", ".join(f"{p}: stored {s}, batch starts {b}" for p, (s, b) in partitions.items())
        super().__init__(f"fenced on partitions {detail}")
        self.partitions = partitions


@dataclass(frozen=True, slots=True)
class Rejection:
    """A poison message: its coordinates, raw bytes and why (for the DLQ and the table)."""

    message: Inbound
    reason: str
    detail: str
    source: str | None


@dataclass
class BatchResult:
    messages: int = 0
    applied: int = 0
    duplicates: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    block_events: int = 0  # hashes applied (stores + removals)
    noop_removals: int = 0
    gaps: int = 0
    replayed: int = 0
    next_offsets: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass(slots=True)
class _Health:
    epoch: int
    last_seq: int
    gap_count: int = 0
    missing_events: int = 0
    epoch_changes: int = 0
    duplicates: int = 0
    last_event_time: datetime | None = None
    dirty: bool = False


@dataclass(slots=True)
class _Interval:
    stored_at: datetime
    locality: str | None
    partition: int
    offset: int
    removed_at: datetime | None = None
    removed_by: str | None = None


@dataclass(slots=True)
class _Res:
    refcount: int
    existed: bool
    locality: str | None = None
    since: datetime | None = None
    topic: str = ""
    partition: int = 0
    offset: int = 0
    close_existing_at: datetime | None = None
    close_existing_by: str | None = None
    intervals: list[_Interval] = field(default_factory=list)
    touched: bool = False


@dataclass(slots=True)
class _BlockWrite:
    row: BlockRow
    lora_name: str | None
    extra_keys: str | None
    first_seen: datetime
    last_seen: datetime


def _ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def _medium(value: str | None) -> str:
    # vLLM's GPU block pool events predate the medium field: absent means GPU.
    return value if value is not None else MEDIUM_GPU


def _group(event: BlockStored | BlockRemoved | AllBlocksCleared | GroupSpec) -> int:
    group = event.group_idx
    return group if group is not None else 0


_TEMP_TABLES = """
CREATE TEMP TABLE IF NOT EXISTS tmp_blocks (LIKE kvledger.blocks) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS tmp_res (
    model text, group_idx integer, block_hash bytea, instance text, medium text,
    ownership text, locality text, since timestamptz, kafka_topic text,
    kafka_partition integer, kafka_offset bigint, refcount integer
) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS tmp_close (
    model text, group_idx integer, block_hash bytea, instance text, medium text,
    ownership text, removed_at timestamptz, removed_by text
) ON COMMIT DELETE ROWS;
"""


class BatchApplier:
    """Applies batches on one connection (see the module docstring for the order of work)."""

    def __init__(self, consumer_group: str) -> None:
        self.consumer_group = consumer_group
        self._prepared: set[int] = set()  # connections whose temp tables exist

    def _temp_tables(self, conn: psycopg.Connection, cur: psycopg.Cursor) -> None:
        # Temp tables live as long as the session; create them once per connection.
        key = id(conn.pgconn)
        if key not in self._prepared:
            cur.execute(_TEMP_TABLES)
            self._prepared.add(key)

    # ------------------------------------------------------------------ entry points
    def apply(self, conn: psycopg.Connection, batch: Sequence[Decoded]) -> BatchResult:
        """Apply consumed messages and write the offsets; raises FencedError when fenced."""
        try:
            with conn.cursor() as cur:
                self._temp_tables(conn, cur)
                next_offsets = self._fence(cur, batch)
                run = _Run(cur, check_sequence=True)
                result = run.process(batch)
                run.write_audit_inserts()
                self._write_offsets(cur, next_offsets)
                result.next_offsets = next_offsets
                return result
        except BaseException:
            # A rolled-back transaction may have taken the temp tables' creation with it.
            self._prepared.discard(id(conn.pgconn))
            raise

    def replay(self, conn: psycopg.Connection, batch: Sequence[Decoded]) -> BatchResult:
        """Re-apply rejected messages (no sequence checks, no offsets). Idempotent."""
        try:
            with conn.cursor() as cur:
                self._temp_tables(conn, cur)
                run = _Run(cur, check_sequence=False)
                result = run.process(batch)
                run.write_replay_updates()
                return result
        except BaseException:
            self._prepared.discard(id(conn.pgconn))
            raise

    # ------------------------------------------------------------------ offsets
    def _fence(self, cur: psycopg.Cursor, batch: Sequence[Decoded]) -> dict[tuple[str, int], int]:
        first: dict[tuple[str, int], int] = {}
        nxt: dict[tuple[str, int], int] = {}
        for d in batch:
            tp = (d.message.topic, d.message.partition)
            first.setdefault(tp, d.message.offset)
            nxt[tp] = d.message.offset + 1
        if not first:
            return nxt
        topics = [t for t, _ in first]
        parts = [p for _, p in first]
        # A partition never written before gets its row now, at this batch's start: a second
        # consumer holding the same first batch then waits on that row and is fenced when
        # it sees the advanced offset (with no row, both would insert and apply).
        cur.execute(
            """
            INSERT INTO kvledger.consumer_offsets
                (consumer_group, kafka_topic, kafka_partition, next_offset)
            SELECT %s, t, p, n FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS k(t, p, n)
            ON CONFLICT (consumer_group, kafka_topic, kafka_partition) DO NOTHING
            """,
            (self.consumer_group, topics, parts, list(first.values())),
        )
        cur.execute(
            """
            SELECT o.kafka_topic, o.kafka_partition, o.next_offset
            FROM kvledger.consumer_offsets o
            JOIN unnest(%s::text[], %s::int[]) AS k(kafka_topic, kafka_partition)
              USING (kafka_topic, kafka_partition)
            WHERE o.consumer_group = %s
            ORDER BY o.kafka_topic, o.kafka_partition
            FOR UPDATE OF o
            """,
            (topics, parts, self.consumer_group),
        )
        fenced = {}
        for topic, partition, stored in cur.fetchall():
            start = first[(topic, partition)]
            if stored != start:
                fenced[partition] = (stored, start)
        if fenced:
            raise FencedError(fenced)
        return nxt

    def _write_offsets(self, cur: psycopg.Cursor, nxt: dict[tuple[str, int], int]) -> None:
        if not nxt:
            return
        cur.execute(
            """
            INSERT INTO kvledger.consumer_offsets AS o
                (consumer_group, kafka_topic, kafka_partition, next_offset)
            SELECT %s, t, p, n FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS k(t, p, n)
            ON CONFLICT (consumer_group, kafka_topic, kafka_partition)
            DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now()
            """,
            (
                self.consumer_group,
                [t for t, _ in nxt],
                [p for _, p in nxt],
                list(nxt.values()),
            ),
        )


class _Run:
    """The in-memory state of one batch: preloaded rows, then the batch's changes."""

    def __init__(self, cur: psycopg.Cursor, check_sequence: bool) -> None:
        self.cur = cur
        self.check_sequence = check_sequence
        self.specs: dict[GroupKey, Spec] = {}
        self.new_specs: dict[GroupKey, tuple[GroupSpec, str]] = {}
        self.blocks: dict[BlockKey, BlockRow] = {}
        self.block_writes: dict[BlockKey, _BlockWrite] = {}
        self.res: dict[ResKey, _Res] = {}
        self.health: dict[tuple[str, str, int], _Health] = {}
        self.audit: list[tuple[object, ...]] = []
        self.result = BatchResult()

    # ------------------------------------------------------------------ preload
    def _preload(self, batch: Sequence[Decoded]) -> None:
        cur = self.cur
        cur.execute(
            "SELECT model, group_idx, kind, block_size, hash_block_size, sliding_window, origin "
            "FROM kvledger.group_specs"
        )
        for model, group, kind, bs, hbs, sw, origin in cur.fetchall():
            self.specs[(model, group)] = Spec(kind, bs, hbs, sw, origin)
        hashes_by_group: dict[GroupKey, set[bytes]] = defaultdict(set)
        hashes_by_holder: dict[HolderKey, set[bytes]] = defaultdict(set)
        sources: set[str] = set()
        for d in batch:
            env = d.envelope
            if env is None:
                continue
            sources.add(env.source)
            ev = env.event
            if isinstance(ev, BlockStored | BlockRemoved):
                group = _group(ev)
                holder = (env.model, group, env.source, _medium(ev.medium), ev.ownership or "")
                hashes_by_holder[holder].update(ev.block_hashes)
                if isinstance(ev, BlockStored):
                    hashes_by_group[(env.model, group)].update(ev.block_hashes)
        for (model, group), hashes in hashes_by_group.items():
            cur.execute(
                "SELECT b.block_hash, b.parent_hash, b.token_start, b.token_ids, b.block_size, "
                "b.partial FROM unnest(%b::bytea[]) AS q(h) JOIN kvledger.blocks b "
                "ON b.model = %s AND b.group_idx = %s AND b.block_hash = q.h",
                (list(hashes), model, group),
            )
            for h, parent, start, tokens, size, partial in cur.fetchall():
                self.blocks[(model, group, h)] = BlockRow(
                    parent, start, tuple(tokens), size, partial
                )
        for holder, hashes in hashes_by_holder.items():
            self._load_residencies(holder, list(hashes))
        if self.check_sequence and sources:
            cur.execute(
                "SELECT source, model, group_idx, epoch, last_seq, gap_count, missing_events, "
                "epoch_changes, duplicates, last_event_time FROM kvledger.source_health "
                "WHERE source = ANY(%s)",
                (list(sources),),
            )
            for row in cur.fetchall():
                self.health[(row[0], row[1], row[2])] = _Health(*row[3:])

    def _load_residencies(self, holder: HolderKey, hashes: list[bytes] | None) -> None:
        model, group, instance, medium, ownership = holder
        columns = (
            "r.block_hash, r.refcount, r.locality, r.since, r.kafka_topic, r.kafka_partition, "
            "r.kafka_offset"
        )
        holder_is = (
            "r.model = %s AND r.group_idx = %s AND r.instance = %s AND r.medium = %s "
            "AND r.ownership = %s"
        )
        params: tuple[object, ...] = (model, group, instance, medium, ownership)
        if hashes is None:
            self.cur.execute(
                f"SELECT {columns} FROM kvledger.residencies r WHERE {holder_is}", params
            )
        else:
            self.cur.execute(
                f"SELECT {columns} FROM unnest(%b::bytea[]) AS q(h) JOIN kvledger.residencies r "
                f"ON r.block_hash = q.h AND {holder_is}",
                (hashes, *params),
            )
        for h, refcount, locality, since, topic, partition, offset in self.cur.fetchall():
            key = (model, group, h, instance, medium, ownership)
            if key not in self.res:
                self.res[key] = _Res(refcount, True, locality, since, topic, partition, offset)

    # ------------------------------------------------------------------ the walk
    def process(self, batch: Sequence[Decoded]) -> BatchResult:
        self._preload(batch)
        result = self.result
        for d in batch:
            result.messages += 1
            msg = d.message
            if d.envelope is None:
                assert d.error is not None
                self._reject(d, Reason(d.error.reason), d.error.detail, None)
                continue
            env = d.envelope
            when = _ts(env.event_time_ms)  # once per message
            if self.check_sequence:
                verdict = self._sequence(env, when)
                if verdict == "stale":
                    self._reject(
                        d,
                        Reason.STALE_EPOCH,
                        f"epoch {env.epoch} is older than the source's current epoch",
                        when,
                    )
                    continue
                if verdict == "duplicate":
                    result.duplicates += 1
                    self._audit(d, "duplicate", None, 0, 0, when)
                    continue
            invalid, hashes, noop = self._apply_event(env, msg, when)
            if invalid is not None:
                self._reject(d, invalid.reason, invalid.detail, when)
            else:
                result.applied += 1
                self._audit(d, "applied", "noop_removal" if noop else None, hashes, noop, when)
        self._write()
        return result

    def _sequence(self, env: Envelope, when: datetime) -> str:
        key = (env.source, env.model, _group(env.event))
        h = self.health.get(key)
        if h is None:
            h = _Health(epoch=env.epoch, last_seq=env.seq, last_event_time=when, dirty=True)
            if env.seq != 0:
                h.gap_count, h.missing_events = 1, env.seq
                self.result.gaps += 1
            self.health[key] = h
            return "ok"
        if env.epoch < h.epoch:
            return "stale"
        h.dirty = True
        if env.epoch > h.epoch:
            h.epoch_changes += 1
            h.epoch = env.epoch
            if env.seq != 0:
                h.gap_count += 1
                h.missing_events += env.seq
                self.result.gaps += 1
        elif env.seq <= h.last_seq:
            h.duplicates += 1
            return "duplicate"
        elif env.seq > h.last_seq + 1:
            h.gap_count += 1
            h.missing_events += env.seq - h.last_seq - 1
            self.result.gaps += 1
        h.last_seq = env.seq
        h.last_event_time = when if h.last_event_time is None else max(h.last_event_time, when)
        return "ok"

    def _apply_event(
        self, env: Envelope, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        """Validate and apply one event: (why it is invalid, hashes applied, no-op removals)."""
        ev = env.event
        if isinstance(ev, GroupSpec):
            return self._announce(env, ev)
        if isinstance(ev, BlockStored):
            return self._stored(env, ev, msg, when)
        if isinstance(ev, BlockRemoved):
            return self._removed(env, ev, msg, when)
        return self._cleared(env, ev, msg, when)

    def _announce(self, env: Envelope, ev: GroupSpec) -> tuple[Invalid | None, int, int]:
        if ev.model != env.model:
            return (
                Invalid(
                    Reason.INVALID_EVENT, f"announcement for model {ev.model} from {env.model}"
                ),
                0,
                0,
            )
        key = (ev.model, ev.group_idx)
        invalid = check_announcement(ev, self.specs.get(key))
        if invalid is None and key not in self.specs:
            self.specs[key] = Spec(
                ev.kind, ev.block_size, ev.hash_block_size, ev.sliding_window, "announced"
            )
            self.new_specs[key] = (ev, env.source)
        return invalid, 0, 0

    def _stored(
        self, env: Envelope, ev: BlockStored, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        group = _group(ev)
        invalid = check_stored(ev, self.specs.get((env.model, group)))
        rows = explode(ev) if invalid is None else []
        for h, row in rows:
            known = self.blocks.get((env.model, group, h))
            if known is not None and (why := conflicts(known, row)) is not None:
                invalid = Invalid(Reason.HASH_CONFLICT, f"{why}: hash {h.hex()}")
                break
        if invalid is not None:
            return invalid, 0, 0
        medium = _medium(ev.medium)
        ownership = ev.ownership or ""
        extra_by_block = ev.extra_keys or ()
        for i, (h, row) in enumerate(rows):
            bkey = (env.model, group, h)
            known = self.blocks.get(bkey)
            if known is None or _upgrades(known, row):
                self.blocks[bkey] = row
            write = self.block_writes.get(bkey)
            if write is None:
                self.block_writes[bkey] = _BlockWrite(
                    self.blocks[bkey],
                    ev.lora_name,
                    extra_by_block[i] if i < len(extra_by_block) else None,
                    when,
                    when,
                )
            else:
                write.row = self.blocks[bkey]
                write.first_seen = min(write.first_seen, when)
                write.last_seen = max(write.last_seen, when)
            self._ref(
                (env.model, group, h, env.source, medium, ownership), +1, when, ev.locality, msg
            )
        self.result.block_events += len(rows)
        return None, len(rows), 0

    def _removed(
        self, env: Envelope, ev: BlockRemoved, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        group = _group(ev)
        invalid = check_removed(ev, self.specs.get((env.model, group)))
        if invalid is not None:
            return invalid, 0, 0
        medium = _medium(ev.medium)
        ownership = ev.ownership or ""
        noop = 0
        for h in ev.block_hashes:
            key = (env.model, group, h, env.source, medium, ownership)
            if not self._ref(key, -1, when, ev.locality, msg):
                noop += 1
        self.result.noop_removals += noop
        self.result.block_events += len(ev.block_hashes)
        return None, len(ev.block_hashes), noop

    def _cleared(
        self, env: Envelope, ev: AllBlocksCleared, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        invalid = check_cleared(ev)
        if invalid is not None:
            return invalid, 0, 0
        medium = _medium(ev.medium)
        groups = (
            [ev.group_idx]
            if ev.group_idx is not None
            else sorted({g for (m, g) in self.specs if m == env.model})
        )
        cleared = 0
        for group in groups:
            holder = (env.model, group, env.source, medium, "")
            self._load_residencies(holder, None)
            for key, state in self.res.items():
                if key[:2] == (env.model, group) and key[3:] == holder[2:] and state.refcount > 0:
                    cleared += 1
                    self._ref(key, -state.refcount, when, None, msg, how="cleared")
        return None, cleared, 0

    def _ref(
        self,
        key: ResKey,
        delta: int,
        when: datetime,
        locality: str | None,
        msg: Inbound,
        how: str = "removed",
    ) -> bool:
        """Change a holder's reference count; False for a removal with no reference left."""
        state = self.res.get(key)
        if state is None:
            state = _Res(0, False)
            self.res[key] = state
        if delta < 0 and state.refcount == 0:
            return False
        before = state.refcount
        state.refcount = before + delta
        state.touched = True
        if before == 0 and state.refcount > 0:
            state.locality, state.since = locality, when
            state.topic, state.partition, state.offset = msg.topic, msg.partition, msg.offset
            state.intervals.append(_Interval(when, locality, msg.partition, msg.offset))
        elif before > 0 and state.refcount == 0:
            open_interval = next((i for i in state.intervals if i.removed_at is None), None)
            if open_interval is not None:
                open_interval.removed_at = max(when, open_interval.stored_at)
                open_interval.removed_by = how
            else:  # the interval was opened by an earlier batch
                state.close_existing_at = when
                state.close_existing_by = how
        return True

    # ------------------------------------------------------------------ audit rows
    def _audit(
        self,
        d: Decoded,
        status: str,
        reason: str | None,
        hashes: int,
        noop: int,
        when: datetime | None,
    ) -> None:
        """One audit row; ``when`` is the event time (None for an undecodable message)."""
        msg, env = d.message, d.envelope
        if env is None:
            row: tuple[object, ...] = (
                msg.topic,
                msg.partition,
                msg.offset,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                hashes,
                0,
                status,
                reason,
                None,
            )
        else:
            ev = env.event
            medium = getattr(ev, "medium", None)
            row = (
                msg.topic,
                msg.partition,
                msg.offset,
                env.source,
                env.model,
                env.epoch,
                env.seq,
                type(ev).__name__,
                _group(ev),
                medium if not isinstance(ev, GroupSpec) else None,
                getattr(ev, "ownership", None),
                hashes,
                noop,
                status,
                reason,
                when,
            )
        self.audit.append(row)

    def _reject(self, d: Decoded, reason: Reason, detail: str, when: datetime | None) -> None:
        source = d.envelope.source if d.envelope is not None else None
        self.result.rejected.append(Rejection(d.message, reason.value, detail, source))
        hashes = len(getattr(d.envelope.event, "block_hashes", ())) if d.envelope else 0
        self._audit(d, "rejected", reason.value, hashes, 0, when)

    # ------------------------------------------------------------------ writes
    def _write(self) -> None:
        cur = self.cur
        if self.new_specs:
            cur.executemany(
                """
                INSERT INTO kvledger.group_specs AS g (model, group_idx, kind, block_size,
                    hash_block_size, sliding_window, origin, announced_by)
                VALUES (%s, %s, %s, %s, %s, %s, 'announced', %s)
                ON CONFLICT (model, group_idx) DO NOTHING
                """,
                [
                    (
                        s.model,
                        s.group_idx,
                        s.kind,
                        s.block_size,
                        s.hash_block_size,
                        s.sliding_window,
                        source,
                    )
                    for s, source in self.new_specs.values()
                ],
            )
        if self.block_writes:
            rows = []
            for (model, group, h), w in sorted(self.block_writes.items()):
                r = w.row
                rows.append(
                    (model, group, h, r.parent_hash, r.token_start, r.token_end,
                     _int4_array(r.token_ids), r.block_size, r.partial, w.lora_name,
                     w.extra_keys, w.first_seen, w.last_seen)
                )  # fmt: skip
            _copy(cur, "tmp_blocks", _BLOCK_COLUMNS, rows)
            cur.execute(_MERGE_BLOCKS)
        touched = [(k, s) for k, s in self.res.items() if s.touched]
        if touched:
            closes = [
                (*k, s.close_existing_at, s.close_existing_by)
                for k, s in touched
                if s.close_existing_at is not None
            ]
            if closes:
                _copy(cur, "tmp_close", _CLOSE_COLUMNS, closes)
                cur.execute(_CLOSE_HISTORY)
            intervals = [
                (*k, i.locality, i.stored_at, i.removed_at, i.removed_by, i.partition, i.offset)
                for k, s in touched
                for i in s.intervals
            ]
            _copy(cur, "kvledger.residency_history", _HISTORY_COLUMNS, intervals)
            holders = [
                (*k, s.locality, s.since, s.topic, s.partition, s.offset, s.refcount)
                for k, s in sorted(touched, key=lambda item: item[0])
                if s.refcount > 0 or s.existed
            ]
            _copy(cur, "tmp_res", _RES_COLUMNS, holders)
            cur.execute(_MERGE_RESIDENCIES)
        dirty = [(k, h) for k, h in self.health.items() if h.dirty]
        if dirty:
            cur.executemany(
                """
                INSERT INTO kvledger.source_health AS s (source, model, group_idx, epoch,
                    last_seq, gap_count, missing_events, epoch_changes, duplicates,
                    last_event_time)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
                ON CONFLICT (source, model, group_idx) DO UPDATE SET
                    epoch = EXCLUDED.epoch, last_seq = EXCLUDED.last_seq,
                    gap_count = EXCLUDED.gap_count, missing_events = EXCLUDED.missing_events,
                    epoch_changes = EXCLUDED.epoch_changes, duplicates = EXCLUDED.duplicates,
                    last_event_time = EXCLUDED.last_event_time
                """,
                [
                    (
                        k[0],
                        k[1],
                        k[2],
                        h.epoch,
                        h.last_seq,
                        h.gap_count,
                        h.missing_events,
                        h.epoch_changes,
                        h.duplicates,
                        h.last_event_time,
                    )
                    for k, h in dirty
                ],
            )

    def write_audit_inserts(self) -> None:
        cur = self.cur
        if self.audit:
            _copy(cur, "kvledger.events", _EVENT_COLUMNS, self.audit)
        if self.result.rejected:
            cur.executemany(
                """
                INSERT INTO kvledger.rejected_events (kafka_topic, kafka_partition,
                    kafka_offset, kafka_key, raw, reason, detail, source)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
                ON CONFLICT (kafka_topic, kafka_partition, kafka_offset) DO NOTHING
                """,
                [
                    (
                        r.message.topic,
                        r.message.partition,
                        r.message.offset,
                        r.message.key,
                        r.message.value,
                        r.reason,
                        r.detail,
                        r.source,
                    )
                    for r in self.result.rejected
                ],
            )

    def write_replay_updates(self) -> None:
        """After a replay: applied rows leave the reject list and the audit log says so."""
        rejected = {
            (r.message.topic, r.message.partition, r.message.offset) for r in self.result.rejected
        }
        applied = [row for row in self.audit if (row[0], row[1], row[2]) not in rejected]
        self.result.replayed = len(applied)
        if not applied:
            return
        self.cur.executemany(
            """
            UPDATE kvledger.events SET status = 'applied', reason = 'replayed',
                hash_count = %s, noop_count = %s, applied_at = now()
            WHERE kafka_topic = %s AND kafka_partition = %s AND kafka_offset = %s
            """,
            [(row[11], row[12], row[0], row[1], row[2]) for row in applied],
        )
        self.cur.executemany(
            """
            UPDATE kvledger.rejected_events SET replayed_at = now()
            WHERE kafka_topic = %s AND kafka_partition = %s AND kafka_offset = %s
            """,
            [(row[0], row[1], row[2]) for row in applied],
        )


_KEY_COLUMNS = (
    ("model", "text"),
    ("group_idx", "int4"),
    ("block_hash", "bytea"),
    ("instance", "text"),
    ("medium", "text"),
    ("ownership", "text"),
)
_BLOCK_COLUMNS = (
    ("model", "text"),
    ("group_idx", "int4"),
    ("block_hash", "bytea"),
    ("parent_hash", "bytea"),
    ("token_start", "int8"),
    ("token_end", "int8"),
    ("token_ids", "bytea"),  # int4[] bytes built by _int4_array
    ("block_size", "int4"),
    ("partial", "bool"),
    ("lora_name", "text"),
    ("extra_keys", "text"),
    ("first_seen", "timestamptz"),
    ("last_seen", "timestamptz"),
)
_CLOSE_COLUMNS = (*_KEY_COLUMNS, ("removed_at", "timestamptz"), ("removed_by", "text"))
_HISTORY_COLUMNS = (
    *_KEY_COLUMNS,
    ("locality", "text"),
    ("stored_at", "timestamptz"),
    ("removed_at", "timestamptz"),
    ("removed_by", "text"),
    ("stored_partition", "int4"),
    ("stored_offset", "int8"),
)
_RES_COLUMNS = (
    *_KEY_COLUMNS,
    ("locality", "text"),
    ("since", "timestamptz"),
    ("kafka_topic", "text"),
    ("kafka_partition", "int4"),
    ("kafka_offset", "int8"),
    ("refcount", "int4"),
)
_EVENT_COLUMNS = (
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
)


def _int4_array(values: Sequence[int]) -> bytes:
    """PostgreSQL's binary form of an int4[] in one struct.pack call.

    Binary COPY hands a field's bytes to the column type's receive function, so these bytes
    go out through the plain bytea dumper (see _BLOCK_COLUMNS): far cheaper than adapting a
    Python list element by element.
    """
    n = len(values)
    if n == 0:  # an empty array has no dimensions
        return struct.pack(">iiI", 0, 0, 23)
    body = [4] * (2 * n)  # (length 4, value) per element
    body[1::2] = values
    # ndim 1, no nulls, element oid 23 (int4), length n, lower bound 1, elements.
    return struct.pack(f">iiIii{2 * n}i", 1, 0, 23, n, 1, *body)


def _copy(
    cur: psycopg.Cursor,
    table: str,
    columns: Sequence[tuple[str, str]],
    rows: Sequence[Sequence[object]],
) -> None:
    """Binary COPY of rows into a table (no text escaping: the fast path)."""
    if not rows:
        return
    names = ", ".join(name for name, _ in columns)
    with cur.copy(f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types([kind for _, kind in columns])
        for row in rows:
            copy.write_row(row)


def _upgrades(known: BlockRow, new: BlockRow) -> bool:
    """A full-size or real row replaces a placeholder or partial-tail row of the same hash."""
    if new.placeholder:
        return False
    return known.placeholder or (known.partial and not new.partial)


_CONTENT_SWAP = (
    "blocks.block_size = 0 OR (blocks.partial AND NOT EXCLUDED.partial AND EXCLUDED.block_size > 0)"
)
_MERGE_BLOCKS = f"""
INSERT INTO kvledger.blocks AS blocks
SELECT * FROM tmp_blocks
ON CONFLICT (model, group_idx, block_hash) DO UPDATE SET
    parent_hash = CASE WHEN {_CONTENT_SWAP} THEN EXCLUDED.parent_hash ELSE blocks.parent_hash END,
    token_start = CASE WHEN {_CONTENT_SWAP} THEN EXCLUDED.token_start ELSE blocks.token_start END,
    token_end = CASE WHEN {_CONTENT_SWAP} THEN EXCLUDED.token_end ELSE blocks.token_end END,
    token_ids = CASE WHEN {_CONTENT_SWAP} THEN EXCLUDED.token_ids ELSE blocks.token_ids END,
    partial = CASE WHEN {_CONTENT_SWAP} THEN EXCLUDED.partial ELSE blocks.partial END,
    block_size = CASE WHEN {_CONTENT_SWAP} THEN EXCLUDED.block_size ELSE blocks.block_size END,
    lora_name = COALESCE(blocks.lora_name, EXCLUDED.lora_name),
    extra_keys = COALESCE(blocks.extra_keys, EXCLUDED.extra_keys),
    first_seen = LEAST(blocks.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(blocks.last_seen, EXCLUDED.last_seen)
"""

_CLOSE_HISTORY = """
UPDATE kvledger.residency_history h
SET removed_at = GREATEST(c.removed_at, h.stored_at), removed_by = c.removed_by
FROM tmp_close c
WHERE h.model = c.model AND h.group_idx = c.group_idx AND h.block_hash = c.block_hash
  AND h.instance = c.instance AND h.medium = c.medium AND h.ownership = c.ownership
  AND h.removed_at IS NULL
"""

_MERGE_RESIDENCIES = """
DELETE FROM kvledger.residencies r USING tmp_res t
WHERE t.refcount = 0 AND r.model = t.model AND r.group_idx = t.group_idx
  AND r.block_hash = t.block_hash AND r.instance = t.instance AND r.medium = t.medium
  AND r.ownership = t.ownership;
INSERT INTO kvledger.residencies AS r (model, group_idx, block_hash, instance, medium,
    ownership, locality, since, kafka_topic, kafka_partition, kafka_offset, refcount)
SELECT model, group_idx, block_hash, instance, medium, ownership, locality, since,
    kafka_topic, kafka_partition, kafka_offset, refcount
FROM tmp_res WHERE refcount > 0
ON CONFLICT (model, group_idx, block_hash, instance, medium, ownership) DO UPDATE SET
    refcount = EXCLUDED.refcount, locality = EXCLUDED.locality, since = EXCLUDED.since,
    kafka_topic = EXCLUDED.kafka_topic, kafka_partition = EXCLUDED.kafka_partition,
    kafka_offset = EXCLUDED.kafka_offset
"""
