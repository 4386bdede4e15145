"""Bounded storage: time partitions made ahead, old ones dropped, dead blocks deleted.

History (``residency_history``), the audit log (``events``, ``rejected_events``) and routing
decisions (``decisions``, kept as long as the audit log) are partitioned by the time the
index wrote or closed each row (migrations 0014, 0018). A pass:

1. makes the partitions from now to some way ahead (three intervals, or up to ten minutes'
   worth of at most 30);
2. drops every partition that ended before its table's cut-off (now minus its retention) and
   moves the table's retained window (``kvledger.retained_windows``) to that partition's end,
   one table a transaction (so a pass never waits for one table while holding another);
3. deletes block rows that no residency holds and no retained history interval names, last
   seen before now minus the block retention, a slice of the table at a time (a sweep through
   its pages, each slice its own short transaction) until its time budget is spent;
4. trims the audit tables that are not partitioned, past the audit retention: engines'
   restarts, goodbyes and losses (``lifecycle_events``: each source's newest of each kind is
   kept, so "last restart" stays known) and the records of the decisions topic that were not
   decisions (``rejected_decisions``), a slice at a time, moving ``lifecycle_events``'s
   retained window.

Every statement runs with a lock timeout: dropping a partition needs a moment's exclusive
lock on its table, and a pass that cannot have it at once gives up until the next pass
instead of queueing in front of the consumer's batches. The running consumer calls
:func:`run_pass` from a thread of its own every ``every_s`` seconds (:class:`Retainer`);
``kvledger retention --once`` runs one pass.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psycopg

from kvledger.consumer import metrics
from kvledger.consumer.db import connect
from kvledger.consumer.retention_policy import Retention

logger = logging.getLogger(__name__)


@dataclass
class PassReport:
    """What one pass did, and where each table's retained window starts now."""

    made: int = 0
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (table, partition)
    blocks_deleted: int = 0
    audit_trimmed: dict[str, int] = field(default_factory=dict)  # table -> rows deleted
    windows: dict[str, datetime] = field(default_factory=dict)
    skipped: str | None = None  # why the drops waited for the next pass (a lock held)
    seconds: float = 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "made": self.made,
            "dropped": [{"table": t, "partition": p} for t, p in self.dropped],
            "blocks_deleted": self.blocks_deleted,
            "audit_trimmed": self.audit_trimmed,
            "skipped": self.skipped,
            "seconds": self.seconds,
        }


@dataclass(frozen=True, slots=True)
class TablePartitions:
    partitions: int
    first: datetime | None  # where the oldest partition starts
    last: datetime | None  # where the newest one ends


@dataclass(frozen=True, slots=True)
class RetentionStatus:
    """The partition interval, each partitioned table's partitions and every window."""

    interval: timedelta
    tables: dict[str, TablePartitions]
    windows: dict[str, datetime]

    def as_json(self) -> dict[str, object]:
        return {
            "partition_interval_s": self.interval.total_seconds(),
            "tables": {
                name: {"partitions": t.partitions, "from": t.first, "to": t.last}
                for name, t in self.tables.items()
            },
            "retained_since": self.windows,
        }


def status(conn: psycopg.Connection) -> RetentionStatus:
    rows = conn.execute(
        "SELECT p.parent, count(t.partition), min(t.lo), max(t.hi) "
        "FROM unnest(ARRAY['residency_history', 'events', 'rejected_events', 'decisions']) "
        "AS p(parent) "
        "LEFT JOIN kvledger.time_partitions t ON t.parent = p.parent GROUP BY p.parent "
        "ORDER BY p.parent"
    ).fetchall()
    tables = {str(p): TablePartitions(int(n), lo, hi) for p, n, lo, hi in rows}
    return RetentionStatus(partition_interval(conn), tables, windows(conn))


def partition_interval(conn: psycopg.Connection) -> timedelta:
    row = conn.execute("SELECT partition_interval FROM kvledger.retention_settings").fetchone()
    assert row is not None
    value: timedelta = row[0]
    return value


def set_partition_interval(conn: psycopg.Connection, interval: timedelta) -> int:
    """A new partition interval; returns the partitions made at it."""
    with conn.transaction():
        row = conn.execute("SELECT kvledger.set_partition_interval(%s)", (interval,)).fetchone()
    return int(row[0]) if row else 0


def windows(conn: psycopg.Connection) -> dict[str, datetime]:
    """Where each table's retained rows start (a table never trimmed is not named; none on
    a schema from before revision 0014)."""
    try:
        with conn.transaction():
            rows = conn.execute("SELECT what, since FROM kvledger.retained_windows").fetchall()
    except psycopg.errors.UndefinedTable:
        return {}
    return {str(what): since for what, since in rows}


def ensure_partitions(conn: psycopg.Connection) -> int:
    """Make the partitions from now to some way ahead: three intervals, or up to ten
    minutes' worth of at most 30 of them (as kvledger.set_partition_interval does)."""
    with conn.transaction():
        row = conn.execute(
            "SELECT kvledger.ensure_partitions(now(), now() + greatest(3 * partition_interval, "
            "least(interval '10 minutes', 30 * partition_interval))) "
            "FROM kvledger.retention_settings"
        ).fetchone()
    return int(row[0]) if row else 0


_EXPIRE_BLOCKS = """
WITH candidates AS (
    SELECT b.ctid AS tid FROM kvledger.blocks b
    WHERE b.ctid >= %(lo)s::tid AND b.ctid < %(hi)s::tid AND b.last_seen < %(cut)s
      AND NOT EXISTS (SELECT 1 FROM kvledger.residencies r WHERE r.model = b.model
                      AND r.group_idx = b.group_idx AND r.block_hash = b.block_hash)
      AND NOT EXISTS (SELECT 1 FROM kvledger.residency_history h WHERE h.model = b.model
                      AND h.group_idx = b.group_idx AND h.block_hash = b.block_hash)
)
DELETE FROM kvledger.blocks b USING candidates c WHERE b.ctid = c.tid AND b.last_seen < %(cut)s
"""


# The time-partitioned tables, in the order a pass drops their partitions.
PARTITIONED = ("residency_history", "events", "rejected_events", "decisions")
# Each slice deletes at most TRIM_SLICE rows in a short transaction of its own.
TRIM_SLICE = 5000
_TRIM = {
    "lifecycle_events": """
DELETE FROM kvledger.lifecycle_events WHERE ctid IN (
    SELECT l.ctid FROM kvledger.lifecycle_events l WHERE l.event_time < %(cut)s
      AND EXISTS (SELECT 1 FROM kvledger.lifecycle_events n WHERE n.source = l.source
                  AND n.kind = l.kind AND n.event_time > l.event_time)
    LIMIT %(slice)s)
""",
    "rejected_decisions": """
DELETE FROM kvledger.rejected_decisions WHERE ctid IN (
    SELECT ctid FROM kvledger.rejected_decisions WHERE recorded_at < %(cut)s LIMIT %(slice)s)
""",
}


def trim_audit(conn: psycopg.Connection, cut: datetime, budget_s: float) -> dict[str, int]:
    """Delete the unpartitioned audit rows older than ``cut`` (see the module docstring),
    slice by slice for up to ``budget_s`` seconds; the rows deleted per table."""
    deadline = time.monotonic() + budget_s
    deleted: dict[str, int] = {}
    for table, sql in _TRIM.items():
        while True:
            with conn.transaction():
                n = max(conn.execute(sql, {"cut": cut, "slice": TRIM_SLICE}).rowcount, 0)
            deleted[table] = deleted.get(table, 0) + n
            if n < TRIM_SLICE or time.monotonic() >= deadline:
                break
    if deleted.get("lifecycle_events"):
        _move_window(conn, "lifecycle_events", cut)
    return deleted


def _move_window(conn: psycopg.Connection, what: str, since: datetime) -> None:
    with conn.transaction():
        conn.execute(
            "INSERT INTO kvledger.retained_windows AS w (what, since) VALUES (%s, %s) "
            "ON CONFLICT (what) DO UPDATE SET since = greatest(w.since, EXCLUDED.since), "
            "updated_at = now()",
            (what, since),
        )


class BlockSweep:
    """Where the sweep through ``blocks`` stands: its next page (kept between passes)."""

    def __init__(self, pages_per_slice: int = 256) -> None:
        self.page = 0
        self.pages_per_slice = pages_per_slice

    def run(self, conn: psycopg.Connection, cut: datetime, budget_s: float) -> int:
        """Delete expired blocks slice by slice for up to ``budget_s`` seconds (at least one
        slice; at most one sweep of the whole table)."""
        deleted = 0
        deadline = time.monotonic() + budget_s
        row = conn.execute(
            "SELECT pg_relation_size('kvledger.blocks') / current_setting('block_size')::int"
        ).fetchone()
        pages = int(row[0]) if row else 0
        swept = 0
        while True:
            if self.page >= pages:
                self.page = 0
            lo, hi = self.page, self.page + self.pages_per_slice
            with conn.transaction():
                cur = conn.execute(
                    _EXPIRE_BLOCKS, {"lo": f"({lo},0)", "hi": f"({hi},0)", "cut": cut}
                )
                deleted += max(cur.rowcount, 0)
            self.page = hi
            swept += self.pages_per_slice
            if swept >= pages or time.monotonic() >= deadline:
                return deleted


def run_pass(
    conn: psycopg.Connection,
    retention: Retention,
    sweep: BlockSweep | None = None,
    block_budget_s: float = 1.0,
    lock_timeout: str = "2s",
) -> PassReport:
    """One retention pass on ``conn`` (autocommit; see the module docstring)."""
    started = time.monotonic()
    report = PassReport()
    sweep = sweep or BlockSweep()
    conn.execute("SELECT set_config('lock_timeout', %s, false)", (lock_timeout,))
    try:
        report.made = ensure_partitions(conn)
    except psycopg.errors.LockNotAvailable as exc:
        report.skipped = f"a table was busy ({exc.diag.message_primary}); next pass"
    for table in PARTITIONED:
        # One table a transaction: its lock is never held while another's is waited for.
        try:
            with conn.transaction():
                rows = conn.execute(
                    "SELECT parent, partition "
                    "FROM kvledger.drop_table_partitions(now() - %s, now() - %s, %s)",
                    (retention.history, retention.audit, table),
                ).fetchall()
            report.dropped += [(str(p), str(n)) for p, n in rows]
        except psycopg.errors.LockNotAvailable as exc:
            report.skipped = f"a table was busy ({exc.diag.message_primary}); next pass"
    if report.skipped:
        logger.info("retention: %s", report.skipped)
    cut_row = conn.execute("SELECT now() - %s", (retention.blocks,)).fetchone()
    assert cut_row is not None
    cut: datetime = cut_row[0]
    report.blocks_deleted = sweep.run(conn, cut, block_budget_s)
    if report.blocks_deleted:
        _move_window(conn, "blocks", cut)
    audit_row = conn.execute("SELECT now() - %s", (retention.audit,)).fetchone()
    assert audit_row is not None
    report.audit_trimmed = trim_audit(conn, audit_row[0], block_budget_s)
    report.windows = windows(conn)
    report.seconds = time.monotonic() - started
    _count(report)
    return report


def _count(report: PassReport) -> None:
    metrics.RETENTION_PASSES.labels("skipped" if report.skipped else "done").inc()
    for table, _ in report.dropped:
        metrics.PARTITIONS_DROPPED.labels(table).inc()
    metrics.BLOCKS_EXPIRED.inc(report.blocks_deleted)
    for table, since in report.windows.items():
        metrics.RETAINED_SINCE.labels(table).set(since.timestamp())


class Retainer:
    """Runs a retention pass every ``every_s`` seconds on a connection of its own, off the
    consumer's apply path; a failed pass is logged and tried again at the next."""

    def __init__(self, database_url: str, retention: Retention, every_s: float = 60.0) -> None:
        self.database_url = database_url
        self.retention = retention
        self.every_s = every_s
        self.sweep = BlockSweep()
        self.last: PassReport | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvledger-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        conn: psycopg.Connection | None = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = connect(self.database_url, autocommit=True)
                self.last = run_pass(conn, self.retention, self.sweep)
                trimmed = sum(self.last.audit_trimmed.values())
                if self.last.dropped or self.last.blocks_deleted or trimmed:
                    logger.info(
                        "retention: dropped %d partitions, deleted %d blocks and %d old audit "
                        "rows in %.2f s",
                        len(self.last.dropped),
                        self.last.blocks_deleted,
                        trimmed,
                        self.last.seconds,
                    )
            except psycopg.Error as exc:
                logger.warning("retention pass failed (next in %.0f s): %s", self.every_s, exc)
                if conn is not None:
                    conn.close()
                conn = None
            except Exception:  # a bug: logged, and the consumer's retention goes on
                logger.exception("retention pass failed (next in %.0f s)", self.every_s)
            self._stop.wait(self.every_s)
        if conn is not None:
            conn.close()
