"""Check the index against the log, and rebuild it from the log.

verify: replay the topic from its beginning into a scratch database, stopping exactly at the
live index's stored offsets, then compare every table (minus wall-clock columns). Declared
group specs are copied first (they are operator input, not in the log). Operator replays
of rejected events are not in the log either, so they show up as differences.

rebuild: replace the live index with one rebuilt from the topic (declared specs kept).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import psycopg
import sqlalchemy as sa

from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect, create_database, drop_database, migrate
from kvledger.consumer.service import IndexConsumer, RunSummary, stored_offsets
from kvledger.consumer.store.postgres import load_specs, upsert_group_specs
from kvledger.consumer.store.tables import COMPARED

# Every compared table's columns (wall-clock ones left out), from the one table list.
COLUMNS: Mapping[str, str] = {name: ", ".join(t.compared) for name, t in COMPARED.items()}


def _value(v: object) -> object:
    if isinstance(v, memoryview):
        return bytes(v)
    if isinstance(v, list):
        return tuple(v)
    return v


def dump(conn: psycopg.Connection) -> dict[str, Counter[tuple[object, ...]]]:
    """Every table as a multiset of rows (wall-clock columns left out)."""
    out = {}
    for table, cols in COLUMNS.items():
        rows = conn.execute(f"SELECT {cols} FROM kvledger.{table}").fetchall()
        out[table] = Counter(tuple(_value(v) for v in row) for row in rows)
    return out


@dataclass
class TableDiff:
    table: str
    only_live: list[tuple[object, ...]] = field(default_factory=list)
    only_rebuilt: list[tuple[object, ...]] = field(default_factory=list)


def diff(
    live: dict[str, Counter[tuple[object, ...]]], rebuilt: dict[str, Counter[tuple[object, ...]]]
) -> list[TableDiff]:
    out = []
    for table in COLUMNS:
        a, b = live[table], rebuilt[table]
        if a != b:
            only_live = sorted((a - b).elements(), key=repr)
            only_rebuilt = sorted((b - a).elements(), key=repr)
            out.append(TableDiff(table, only_live, only_rebuilt))
    return out


def _copy_declared(live: psycopg.Connection, target: psycopg.Connection) -> int:
    declared = [
        (held.spec, None) for held in load_specs(live).values() if held.origin == "declared"
    ]
    with target.transaction():
        upsert_group_specs(target, declared, "declared")
    return len(declared)


@dataclass
class VerifyResult:
    differences: list[TableDiff]
    rebuilt: RunSummary
    targets: dict[int, int]
    rows: dict[str, int]

    @property
    def ok(self) -> bool:
        return not self.differences


def verify(
    bootstrap: str,
    live_url: str,
    topic: str,
    group: str,
    scratch_url: str | None = None,
) -> VerifyResult:
    """Rebuild into a scratch database up to the live offsets and compare."""
    created = scratch_url is None
    if scratch_url is None:
        name = f"{sa.engine.make_url(live_url).database}_verify_{uuid.uuid4().hex[:8]}"
        scratch_url = create_database(live_url, name)
    try:
        migrate(scratch_url)
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            _copy_declared(live, scratch)
            targets = stored_offsets(live, group, topic)
        summary = IndexConsumer(
            ConsumerConfig(
                bootstrap_servers=bootstrap,
                database_url=scratch_url,
                topic=topic,
                # Its own Kafka group: joining the live one would take its partitions.
                group_id=f"{group}-verify-{uuid.uuid4().hex[:8]}",
                dlq_topic=None,
                stop_at=targets,
                until_caught_up=not targets,
                batch_size=5000,
                batch_timeout_s=0.2,
            )
        ).run()
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            a, b = dump(live), dump(scratch)
        return VerifyResult(
            diff(a, b), summary, targets, {t: sum(c.values()) for t, c in a.items()}
        )
    finally:
        if created:
            drop_database(live_url, str(sa.engine.make_url(scratch_url).database))


def rebuild(bootstrap: str, live_url: str, topic: str, group: str) -> RunSummary:
    """Replace the live index with one rebuilt from the topic (declared specs kept).

    Stop the consumers of ``group`` first. Rejections are stored again but not re-sent to
    the dead-letter topic, which already holds them.
    """
    # One TRUNCATE takes every table's lock before it changes anything (dropping the schema
    # instead can deadlock with an autovacuum ANALYZE of one of its tables), and restarts
    # the id sequences as a fresh index has them.
    migrate(live_url)
    with connect(live_url, autocommit=True) as conn, conn.transaction():
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'kvledger' "
                "AND tablename NOT IN ('group_specs', 'alembic_version') ORDER BY tablename"
            )
        ]
        conn.execute("TRUNCATE " + ", ".join(f"kvledger.{t}" for t in tables) + " RESTART IDENTITY")
        conn.execute("DELETE FROM kvledger.group_specs WHERE origin <> 'declared'")
    return IndexConsumer(
        ConsumerConfig(
            bootstrap_servers=bootstrap,
            database_url=live_url,
            topic=topic,
            group_id=group,
            dlq_topic=None,
            until_caught_up=True,
            batch_size=5000,
            batch_timeout_s=0.2,
        )
    ).run()
