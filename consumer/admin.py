"""Operator actions: declare group specs, inspect and replay the dead-letter table."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg

from kvledger.consumer.core.validate import check_announcement
from kvledger.consumer.inbound import Inbound, decode
from kvledger.consumer.pipeline import replay_batch
from kvledger.consumer.store.pg_state import upsert_group_specs
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.events import GroupSpec


class InvalidSpecError(KvledgerError):
    """A declared spec that is not well-formed."""


def declare_group(conn: psycopg.Connection, spec: GroupSpec) -> None:
    """Declare (or re-declare) a group's spec; a declared spec wins over announcements."""
    invalid = check_announcement(spec, None)
    if invalid is not None:
        raise InvalidSpecError(invalid.detail)
    with conn.transaction():
        upsert_group_specs(conn, [(spec, None)], "declared")


def list_groups(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    return conn.execute(
        "SELECT model, group_idx, kind, block_size, hash_block_size, sliding_window, origin, "
        "announced_by, updated_at FROM kvledger.group_specs ORDER BY model, group_idx"
    ).fetchall()


def dlq_summary(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    """(reason, pending, replayed, first, last) per reason, from the auditors' view."""
    return conn.execute(
        "SELECT reason, pending, total - pending, first_seen, last_seen "
        "FROM kvledger.rejected_summary ORDER BY reason"
    ).fetchall()


def dlq_rows(
    conn: psycopg.Connection, reason: str | None = None, limit: int = 20
) -> list[tuple[object, ...]]:
    return conn.execute(
        """
        SELECT id, kafka_topic, kafka_partition, kafka_offset, source, reason, detail,
               first_seen, replayed_at
        FROM kvledger.rejected_events
        WHERE (%(reason)s::text IS NULL OR reason = %(reason)s)
        ORDER BY id DESC LIMIT %(limit)s
        """,
        {"reason": reason, "limit": limit},
    ).fetchall()


@dataclass
class ReplayResult:
    considered: int
    replayed: int
    still_rejected: dict[str, int]


def replay(
    conn: psycopg.Connection,
    codec: Codec | None = None,
    reason: str | None = None,
    batch_size: int = 1000,
) -> ReplayResult:
    """Re-apply pending rejected events in Kafka order; applied ones are marked replayed.

    Idempotent: a replayed row is never applied again. Rows still invalid stay pending.
    Events of a superseded producer epoch (``stale_epoch``) are replayed only when asked for
    by that reason: a newer epoch of the same source has already re-announced its state.
    Re-deliveries (``duplicate``) likewise: their first delivery is applied already, so a
    replay applies them a second time and is for an operator who knows it was not.
    """
    codec = codec or Codec()
    store = PostgresStore(conn)
    considered, replayed = 0, 0
    still: dict[str, int] = {}
    last_id = 0
    while True:
        with conn.transaction():
            rows = conn.execute(
                """
                SELECT id, kafka_topic, kafka_partition, kafka_offset, kafka_key, raw
                FROM kvledger.rejected_events
                WHERE replayed_at IS NULL AND id > %(last)s
                  AND (%(reason)s::text IS NULL OR reason = %(reason)s)
                  AND (reason NOT IN ('stale_epoch', 'duplicate') OR %(reason)s::text = reason)
                ORDER BY id LIMIT %(limit)s FOR UPDATE
                """,
                {"last": last_id, "reason": reason, "limit": batch_size},
            ).fetchall()
            if not rows:
                break
            last_id = rows[-1][0]
            rows.sort(key=lambda r: (r[1], r[2], r[3]))
            batch = [decode(Inbound(t, p, o, k, bytes(v)), codec) for _, t, p, o, k, v in rows]
            plan = replay_batch(batch, store)
        considered += len(rows)
        replayed += plan.replayed
        for r in plan.rejected:
            still[r.reason] = still.get(r.reason, 0) + 1
    return ReplayResult(considered, replayed, still)


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """One source as ``kvledger sources`` shows it (kvledger.source_status, with a window)."""

    source: str
    model: str
    state: str  # live | silent | closed (restarted: live, with a restart inside the window)
    epoch: int
    last_seen: datetime
    restarts: int
    last_restart: datetime | None
    gaps: int
    missing_events: int
    held: dict[str, int]
    previous_model: str | None = None  # before its latest change of model (None: never)
    model_changed_at: datetime | None = None
    # The engine's load as its latest heartbeat that carried one said (None: never said, or
    # ended by a restart or goodbye), and that heartbeat's log time.
    requests_running: int | None = None
    requests_waiting: int | None = None
    load_at: datetime | None = None


def list_sources(
    conn: psycopg.Connection, silent_after: timedelta | None = None
) -> list[SourceStatus]:
    """Every source with its state under ``silent_after`` (else the database's window)."""
    rows = conn.execute(
        """
        SELECT s.source, s.model, kvledger.source_state(s.source, %(w)s), s.epoch, s.last_seen,
               s.restarts, s.last_restart, s.gaps, s.missing_events, s.held_gpu, s.held_cpu,
               s.held_storage,
               s.last_restart > now() - coalesce(%(w)s, kvledger.silent_after()),
               s.previous_model, s.model_changed_at,
               src.requests_running, src.requests_waiting, src.load_at
        FROM kvledger.source_status s JOIN kvledger.sources src USING (source)
        ORDER BY s.source
        """,
        {"w": silent_after},
    ).fetchall()
    out = []
    for row in rows:
        source, model, state, epoch, seen, restarts, last_restart, gaps, missing = row[:9]
        if state == "live" and row[12]:
            state = "restarted"
        held = {"GPU": int(row[9]), "CPU": int(row[10]), "STORAGE": int(row[11])}
        out.append(
            SourceStatus(
                source,
                model,
                state,
                epoch,
                seen,
                restarts,
                last_restart,
                gaps,
                missing,
                held,
                *row[13:18],
            )
        )
    return out
