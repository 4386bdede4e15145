"""The PostgreSQL store: the durable index (schema ``kvledger``, built by the migrations).

Inside one transaction per batch: :meth:`fence` locks the batch's offset rows and compares;
:meth:`load` reads only what the batch touches (joins of hash arrays to the primary keys);
:meth:`write` merges the plan with a few bulk statements (binary COPY into temporary tables,
then one merge per table) and stores the next offsets, so the index and its cursor commit
together.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg

from kvledger.consumer import metrics
from kvledger.consumer.core.audit import replay_reason
from kvledger.consumer.core.compact import micros
from kvledger.consumer.core.model import (
    BlockKey,
    BlockRow,
    HolderKey,
    Needs,
    Plan,
    Residency,
    ResidencyKey,
    Snapshot,
)
from kvledger.consumer.store import pg_sql as sql
from kvledger.consumer.store.base import FencedError, TopicPartition
from kvledger.consumer.store.copy import copy_data, copy_rows
from kvledger.consumer.store.pg_state import (
    life_row,
    lifecycle_row,
    load_source_lives,
    load_source_states,
    load_specs,
    source_row,
    upsert_group_specs,
)
from kvledger.consumer.store.tables import (
    BLOCKS,
    EVENTS,
    HISTORY_CLOSE,
    LIFECYCLE_EVENTS,
    RESIDENCIES,
    RESIDENCY_HISTORY,
)


class PostgresStore:
    """The index in PostgreSQL, on one connection (autocommit off between transactions)."""

    in_process = False  # load() reads what the needs name

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self._cur: psycopg.Cursor | None = None
        self._prepared = False  # the session's temporary tables exist

    @contextmanager
    def transaction(self) -> Iterator[None]:
        try:
            with self.conn.transaction(), self.conn.cursor() as cur:
                if not self._prepared:
                    cur.execute(sql.TEMP_TABLES)
                    self._prepared = True
                self._cur = cur
                yield
        except BaseException:
            # A rolled-back transaction may have taken the temp tables' creation with it.
            self._prepared = False
            raise
        finally:
            self._cur = None

    @property
    def cur(self) -> psycopg.Cursor:
        if self._cur is None:
            raise RuntimeError("PostgresStore: call inside transaction()")
        return self._cur

    # ------------------------------------------------------------------ offsets
    def fence(self, consumer_group: str, starts: Mapping[TopicPartition, int]) -> None:
        if not starts:
            return
        cur = self.cur
        topics = [t for t, _ in starts]
        parts = [p for _, p in starts]
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
            (consumer_group, topics, parts, list(starts.values())),
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
            (topics, parts, consumer_group),
        )
        fenced = {}
        for topic, partition, stored in cur.fetchall():
            start = starts[(topic, partition)]
            if stored != start:
                fenced[partition] = (stored, start)
        if fenced:
            raise FencedError(fenced)

    def stored_offsets(self, consumer_group: str, topic: str) -> dict[int, int]:
        rows = self.conn.execute(
            "SELECT kafka_partition, next_offset FROM kvledger.consumer_offsets "
            "WHERE consumer_group = %s AND kafka_topic = %s",
            (consumer_group, topic),
        ).fetchall()
        return {int(p): int(o) for p, o in rows}

    def _write_offsets(self, consumer_group: str, nxt: Mapping[TopicPartition, int]) -> None:
        if not nxt:
            return
        self.cur.execute(
            """
            INSERT INTO kvledger.consumer_offsets AS o
                (consumer_group, kafka_topic, kafka_partition, next_offset)
            SELECT %s, t, p, n FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS k(t, p, n)
            ON CONFLICT (consumer_group, kafka_topic, kafka_partition)
            DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now()
            """,
            (consumer_group, [t for t, _ in nxt], [p for _, p in nxt], list(nxt.values())),
        )

    # ------------------------------------------------------------------ load
    def load(self, needs: Needs) -> Snapshot:
        cur = self.cur
        blocks: dict[BlockKey, BlockRow] = {}
        for (model, group), hashes in needs.blocks.items():
            cur.execute(
                "SELECT b.block_hash, b.parent_hash, b.token_start, b.token_ids, b.block_size, "
                "b.partial FROM unnest(%b::bytea[]) AS q(h) JOIN kvledger.blocks b "
                "ON b.model = %s AND b.group_idx = %s AND b.block_hash = q.h",
                (list(hashes), model, group),
            )
            for h, parent, start, tokens, size, partial in cur.fetchall():
                blocks[BlockKey(model, group, h)] = BlockRow(
                    parent, start, tuple(tokens), size, partial
                )
        residencies: dict[ResidencyKey, Residency] = {}
        for holder, hashes in needs.residencies.items():
            model, group, instance, medium, ownership = holder
            cur.execute(
                f"SELECT {sql.RESIDENCY_SELECT} FROM unnest(%b::bytea[]) AS q(h) "
                "JOIN kvledger.residencies r ON r.block_hash = q.h AND r.model = %s "
                "AND r.group_idx = %s AND r.instance = %s AND r.medium = %s AND r.ownership = %s",
                (list(hashes), model, group, instance, medium, ownership),
            )
            for row in cur.fetchall():
                key = ResidencyKey(model, group, row[1], instance, medium, ownership)
                residencies[key] = Residency(*row[2:])
        held: dict[HolderKey, set[bytes]] = {}
        for c in needs.scopes:
            cur.execute(
                f"SELECT {sql.RESIDENCY_SELECT}, r.medium, r.ownership FROM kvledger.residencies r "
                "WHERE r.model = %s AND r.instance = %s "
                "AND (%s::int IS NULL OR r.group_idx = %s::int) "
                "AND (%s::text IS NULL OR r.medium = %s::text) "
                "AND (%s::text IS NULL OR r.ownership = %s::text)",
                (
                    c.model,
                    c.instance,
                    c.group_idx,
                    c.group_idx,
                    c.medium,
                    c.medium,
                    c.ownership,
                    c.ownership,
                ),
            )
            self._hold(cur.fetchall(), c.model, c.instance, residencies, held)
        if needs.restarts:
            # Every residency of the streams this batch moves to a newer epoch.
            streams = list(needs.restarts.items())
            cur.execute(
                f"SELECT {sql.RESIDENCY_SELECT}, r.medium, r.ownership, r.model, r.instance "
                "FROM unnest(%s::text[], %s::text[], %s::int[], %s::bigint[]) "
                "AS q(source, model, group_idx, epoch) "
                "JOIN kvledger.source_health s ON s.source = q.source AND s.model = q.model "
                "AND s.group_idx = q.group_idx AND s.epoch < q.epoch "
                "JOIN kvledger.residencies r ON r.instance = q.source AND r.model = q.model "
                "AND r.group_idx = q.group_idx",
                (
                    [k.source for k, _ in streams],
                    [k.model for k, _ in streams],
                    [k.group_idx for k, _ in streams],
                    [e for _, e in streams],
                ),
            )
            for row in cur.fetchall():
                self._hold([row[:10]], row[10], row[11], residencies, held)
        wanted = list(needs.sources)
        sources = load_source_states(cur, wanted) if wanted else {}
        lives = load_source_lives(cur, wanted) if wanted else {}
        late = self._late_removals(needs) if needs.replayed else []
        return Snapshot(load_specs(cur), blocks, residencies, held, sources, lives, late)

    def _late_removals(self, needs: Needs) -> list[tuple[str, int, int]]:
        """The replayed stores whose holder recorded a no-op removal after them."""
        rows = [(*holder, t, p, o) for holder, t, p, o in needs.replayed]
        self.cur.execute(
            "SELECT q.t, q.p, q.o FROM unnest(%s::text[], %s::int[], %s::text[], %s::text[], "
            "%s::text[], %s::text[], %s::int[], %s::bigint[]) "
            "AS q(model, group_idx, source, medium, ownership, t, p, o) "
            "WHERE EXISTS (SELECT 1 FROM kvledger.events e WHERE e.kafka_topic = q.t "
            "AND e.kafka_partition = q.p AND e.kafka_offset > q.o "
            "AND e.event_type = 'BlockRemoved' AND e.noop_count > 0 AND e.source = q.source "
            "AND e.model = q.model AND e.group_idx = q.group_idx "
            "AND coalesce(e.medium, 'GPU') = q.medium AND coalesce(e.ownership, '') = q.ownership)",
            [list(col) for col in zip(*rows, strict=True)],
        )
        return [(t, p, o) for t, p, o in self.cur.fetchall()]

    @staticmethod
    def _hold(
        rows: list[tuple[Any, ...]],
        model: str,
        instance: str,
        residencies: dict[ResidencyKey, Residency],
        held: dict[HolderKey, set[bytes]],
    ) -> None:
        """Rows of sql.RESIDENCY_SELECT + (medium, ownership) into the snapshot's maps."""
        for row in rows:
            key = ResidencyKey(model, row[0], row[1], instance, row[8], row[9])
            residencies[key] = Residency(*row[2:8])
            held.setdefault(key.holder, set()).add(key.block_hash)

    # ------------------------------------------------------------------ write
    def write(
        self,
        plan: Plan,
        consumer_group: str | None = None,
        next_offsets: Mapping[TopicPartition, int] | None = None,
    ) -> None:
        cur = self.cur
        upsert_group_specs(cur, plan.new_specs, "announced")
        if plan.rows:
            self._write_blocks(plan)
        if plan.refs:
            self._write_residencies(plan)
        if plan.lives:
            cur.executemany(
                sql.UPSERT_LIFE,
                [(source, *life_row(life)) for source, life in plan.lives.items()],
            )
        if plan.lifecycle:
            copy_rows(
                cur,
                LIFECYCLE_EVENTS.qualified,
                LIFECYCLE_EVENTS.columns,
                [lifecycle_row(e) for e in plan.lifecycle],
            )
        if plan.sources:
            cur.executemany(
                sql.UPSERT_SOURCE, [(*k, *source_row(s)) for k, s in plan.sources.items()]
            )
        if plan.replay:
            self._write_replay_updates(plan)
        else:
            copy_rows(cur, EVENTS.qualified, EVENTS.columns, plan.audit)
            if plan.rejected:
                cur.executemany(
                    sql.INSERT_REJECTED,
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
                            r.message.topic,
                            r.message.partition,
                            r.message.offset,
                        )
                        for r in plan.rejected
                    ],
                )
        if consumer_group is not None and next_offsets:
            self._write_offsets(consumer_group, next_offsets)

    def _write_blocks(self, plan: Plan) -> None:
        """Block rows the store had none of when the batch was planned are copied straight
        into the table (a savepoint around them: should another consumer have stored one
        since, they are merged with the rest instead); the others are merged by the rules
        (sql.MERGE_BLOCKS). Each pass goes in key order, so that two writers never wait
        on each other in a cycle: a block one writer copies as new and another merges
        was committed before the second's plan, so the copy meets it at once, not a lock.
        A copy that met another consumer's row is counted (kvledger_new_block_conflicts_total):
        consumers whose partitions store the same new blocks at once."""
        cur, rows = self.cur, plan.rows
        assert rows is not None
        new, stored = rows.copy_binary(False), rows.copy_binary(True)
        if new is not None:
            try:
                with self.conn.transaction():
                    copy_data(cur, BLOCKS.qualified, BLOCKS.columns, new)
            except psycopg.errors.UniqueViolation:
                metrics.NEW_BLOCK_CONFLICTS.inc()
                stored = rows.copy_binary()
        if stored is not None:
            copy_data(cur, "tmp_blocks", BLOCKS.columns, stored)
            cur.execute(sql.MERGE_BLOCKS)

    def _write_residencies(self, plan: Plan) -> None:
        cur, refs = self.cur, plan.refs
        assert refs is not None
        closes = refs.copy_closes()
        if closes is not None:
            copy_data(cur, "tmp_close", HISTORY_CLOSE, closes)
            cur.execute(sql.CLOSE_HISTORY)
        # An interval closed in the batch that opened it goes straight to now's partition.
        closed_at = None
        if refs.closes_own():
            row = cur.execute("SELECT now()").fetchone()
            closed_at = micros(row[0]) if row is not None else None
        intervals = refs.copy_history(closed_at)
        if intervals is not None:
            copy_data(cur, RESIDENCY_HISTORY.qualified, RESIDENCY_HISTORY.columns, intervals)
        # Residencies new to the store are copied straight in, as their open intervals just
        # were; the rest (a count changed, or dropped to 0) are merged. A row another writer
        # stored since the plan fails the copy of its open interval first (one engine's
        # messages on two topics at once), and the batch is then planned again.
        new, held = refs.copy_holders(False), refs.copy_holders(True)
        if new is not None:
            copy_data(cur, RESIDENCIES.qualified, RESIDENCIES.columns, new)
        if held is not None:
            copy_data(cur, "tmp_res", RESIDENCIES.columns, held)
            cur.execute(sql.MERGE_RESIDENCIES)

    def _write_replay_updates(self, plan: Plan) -> None:
        """After a replay: applied rows leave the reject list and the audit log says so."""
        applied = [row for row in plan.audit if row.status == "applied"]
        if not applied:
            return
        self.cur.executemany(
            """
            UPDATE kvledger.events SET status = 'applied', reason = %s,
                hash_count = %s, noop_count = %s, applied_at = now()
            WHERE kafka_topic = %s AND kafka_partition = %s AND kafka_offset = %s
            """,
            [
                (
                    replay_reason(r.reason),
                    r.hash_count,
                    r.noop_count,
                    r.kafka_topic,
                    r.kafka_partition,
                    r.kafka_offset,
                )
                for r in applied
            ],
        )
        self.cur.executemany(
            """
            UPDATE kvledger.rejected_events SET replayed_at = now()
            WHERE kafka_topic = %s AND kafka_partition = %s AND kafka_offset = %s
            """,
            [(r.kafka_topic, r.kafka_partition, r.kafka_offset) for r in applied],
        )
