"""The PostgreSQL index's small tables, read and written whole rows at a time: group specs
(declared or announced), the source streams' sequence states and the sources' lives.

Used by the PostgreSQL store in its transactions, by the router's bootstrap snapshot and by
the operator tools (declare, verify).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import psycopg

from kvledger.consumer.core.model import (
    GroupKey,
    HeldSpec,
    LifecycleEvent,
    SourceKey,
    SourceLife,
    SourceState,
)
from kvledger.schemas.events import GroupSpec


def upsert_group_specs(
    conn: psycopg.Connection | psycopg.Cursor,
    specs: Iterable[tuple[GroupSpec, str | None]],
    origin: Literal["declared", "announced"],
) -> None:
    """Write group specs. A declared spec replaces whatever is held (an operator's word
    wins); an announced one is written only for a group with no spec yet."""
    conflict = (
        "DO UPDATE SET kind = EXCLUDED.kind, block_size = EXCLUDED.block_size, "
        "hash_block_size = EXCLUDED.hash_block_size, sliding_window = "
        "EXCLUDED.sliding_window, origin = 'declared', announced_by = NULL, updated_at = now()"
        if origin == "declared"
        else "DO NOTHING"
    )
    rows = [
        (
            s.model,
            s.group_idx,
            s.kind,
            s.block_size,
            s.hash_block_size,
            s.sliding_window,
            origin,
            by,
        )
        for s, by in specs
    ]
    if not rows:
        return
    cur = conn.cursor() if isinstance(conn, psycopg.Connection) else conn
    cur.executemany(
        "INSERT INTO kvledger.group_specs (model, group_idx, kind, block_size, "
        "hash_block_size, sliding_window, origin, announced_by) "
        f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (model, group_idx) {conflict}",
        rows,
    )


def load_specs(conn: psycopg.Connection | psycopg.Cursor) -> dict[GroupKey, HeldSpec]:
    cur = conn.cursor() if isinstance(conn, psycopg.Connection) else conn
    cur.execute(
        "SELECT model, group_idx, kind, block_size, hash_block_size, sliding_window, origin "
        "FROM kvledger.group_specs"
    )
    return {
        GroupKey(model, group): HeldSpec(GroupSpec(model, group, kind, bs, hbs, sw), origin)
        for model, group, kind, bs, hbs, sw, origin in cur.fetchall()
    }


def load_source_states(
    cur: psycopg.Cursor, sources: list[str] | None = None
) -> dict[SourceKey, SourceState]:
    """The source streams' sequence states (``sources``: only theirs; None: all)."""
    cur.execute(
        "SELECT source, model, group_idx, epoch, last_seq, gap_count, missing_events, "
        "epoch_changes, duplicates, last_event_time, surviving_media, lost_gaps, lost_batches, "
        "reports_reuse "
        "FROM kvledger.source_health WHERE %s::text[] IS NULL OR source = ANY(%s::text[])",
        (sources, sources),
    )
    out = {}
    for row in cur.fetchall():
        epoch, last, gaps, missing, changes, dups, when, media, lost_gaps, lost, reuse = row[3:]
        out[SourceKey(*row[:3])] = SourceState(
            epoch,
            last,
            gaps,
            missing,
            changes,
            dups,
            when,
            tuple(media) if media is not None else None,
            lost_gaps,
            lost,
            reuse,
        )
    return out


def load_source_lives(
    cur: psycopg.Cursor, sources: list[str] | None = None
) -> dict[str, SourceLife]:
    """The sources' lives (``sources``: only theirs; None: all)."""
    cur.execute(
        "SELECT source, model, epoch, last_seen, closed_at, heartbeat_ms, restarts, "
        "previous_model, model_changed_at, requests_running, requests_waiting, load_at "
        "FROM kvledger.sources "
        "WHERE %s::text[] IS NULL OR source = ANY(%s::text[])",
        (sources, sources),
    )
    return {row[0]: SourceLife(*row[1:]) for row in cur.fetchall()}


def source_row(s: SourceState) -> tuple[object, ...]:
    media = list(s.surviving_media) if s.surviving_media is not None else None
    return (
        s.epoch,
        s.last_seq,
        s.gap_count,
        s.missing_events,
        s.epoch_changes,
        s.duplicates,
        s.last_event_time,
        media,
        s.lost_gaps,
        s.lost_batches,
        s.reports_reuse,
    )


def life_row(life: SourceLife) -> tuple[object, ...]:
    return (
        life.model,
        life.epoch,
        life.last_seen,
        life.closed_at,
        life.heartbeat_ms,
        life.restarts,
        life.previous_model,
        life.model_changed_at,
        life.requests_running,
        life.requests_waiting,
        life.load_at,
    )


def lifecycle_row(e: LifecycleEvent) -> tuple[object, ...]:
    return (
        e.source,
        e.model,
        e.group_idx,
        e.kind,
        e.epoch,
        e.previous_epoch,
        e.event_time,
        e.kafka_topic,
        e.kafka_partition,
        e.kafka_offset,
        e.ended_gpu,
        e.ended_cpu,
        e.ended_storage,
        e.first_lost_seq,
        e.last_lost_seq,
    )
