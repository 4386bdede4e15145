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
from kvledger.consumer.service import IndexConsumer, stored_offsets
from kvledger.consumer.store.pg_state import load_specs, upsert_group_specs
from kvledger.consumer.store.tables import COMPARED
from kvledger.consumer.summary import RunSummary
from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, admin_settings

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


def describe_row(table: str, row: tuple[object, ...], width: int = 16) -> str:
    """One compared row as ``column=value`` pairs a person can read: bytes in hex (cut past
    ``width`` bytes), token arrays by their length and first ids."""
    parts = []
    for name, value in zip(COMPARED[table].compared, row, strict=False):
        shown: str
        if isinstance(value, bytes):
            shown = value[:width].hex() + ("…" if len(value) > width else "")
        elif isinstance(value, tuple) and len(value) > 4:
            shown = f"[{', '.join(map(str, value[:4]))}, … {len(value)} in all]"
        elif value is None:
            shown = "NULL"
        else:
            shown = str(value)
        parts.append(f"{name}={shown}")
    return " ".join(parts)


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


def _replay_log(
    bootstrap: str, scratch_url: str, topic: str, group_prefix: str,
    kafka: Mapping[str, object] | None, stop_at: Mapping[int, int] | None = None,
    codec: Codec | None = None,
) -> RunSummary:  # fmt: skip
    """Apply the topic from its start into the index at ``scratch_url``, up to ``stop_at``
    (else to its end), under a Kafka group of its own (``group_prefix`` + a random suffix:
    joining the live group would take its partitions); rejections are stored, not re-sent."""
    return IndexConsumer(
        ConsumerConfig(
            bootstrap_servers=bootstrap,
            database_url=scratch_url,
            topic=topic,
            group_id=f"{group_prefix}{uuid.uuid4().hex[:8]}",
            dlq_topic=None,
            stop_at=stop_at,
            until_caught_up=not stop_at,
            batch_size=5000,
            batch_timeout_s=0.2,
            kafka=kafka or {},
        ),
        codec=codec,
    ).run()


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
    kafka: Mapping[str, object] | None = None,
    codec: Codec | None = None,
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
        summary = _replay_log(
            bootstrap,
            scratch_url,
            topic,
            f"{group}-verify-",
            kafka,
            stop_at=targets,
            codec=codec,
        )
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            a, b = dump(live), dump(scratch)
        return VerifyResult(
            diff(a, b), summary, targets, {t: sum(c.values()) for t, c in a.items()}
        )
    finally:
        if created:
            drop_database(live_url, str(sa.engine.make_url(scratch_url).database))


class RebuildRefusedError(KvledgerError):
    """A rebuild that would lose data or race a running consumer, refused with the reason."""


def rebuild(
    bootstrap: str,
    live_url: str,
    topic: str,
    group: str,
    accept_partial: bool = False,
    kafka: Mapping[str, object] | None = None,
    codec: Codec | None = None,
) -> RunSummary:
    """Replace the live index with one rebuilt from the topic (declared specs kept).

    Refused (:class:`RebuildRefusedError`) while consumers of ``group`` are active, and when a
    partition no longer starts at offset 0 (retention deleted history the index was built
    from) unless ``accept_partial``. The new index is built in a scratch database while the
    live one stays readable, then swapped in, every table in one transaction: nothing is
    truncated before the new index is complete, and a failure leaves the live index as it
    was. Rejections are stored again but not re-sent to the dead-letter topic.
    """
    settings = {**(kafka or {}), "bootstrap.servers": bootstrap}
    _refuse_unsafe(settings, topic, group, accept_partial)
    migrate(live_url)
    name = f"{sa.engine.make_url(live_url).database}_rebuild_{uuid.uuid4().hex[:8]}"
    scratch_url = create_database(live_url, name)
    try:
        migrate(scratch_url)
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            _copy_declared(live, scratch)
        # The live group's offsets are written into the index when it is swapped in.
        summary = _replay_log(
            bootstrap, scratch_url, topic, f"{group}-rebuild-", kafka, codec=codec
        )
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            _swap_in(scratch, live, summary_group=f"{group}-rebuild-", live_group=group)
        return summary
    finally:
        drop_database(live_url, name)


def _refuse_unsafe(
    settings: Mapping[str, object], topic: str, group: str, accept_partial: bool
) -> None:
    from confluent_kafka import Consumer, KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client_logging(admin_settings(settings)))
    try:
        described = admin.describe_consumer_groups([group])[group].result(timeout=STARTUP_TIMEOUT_S)
        members = len(described.members)
    except KafkaException:  # an unknown group has no members
        members = 0
    if members:
        raise RebuildRefusedError(
            f"consumer group {group!r} has {members} active member(s): stop its consumers "
            "before a rebuild (they would write into the index being replaced)"
        )
    probe = Consumer(
        client_logging({**settings, "group.id": f"{group}-rebuild-probe", "log_level": 3})
    )
    try:
        partitions = probe.list_topics(topic, timeout=STARTUP_TIMEOUT_S).topics[topic].partitions
        trimmed = {
            p: low
            for p in partitions
            if (low := probe.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[0]) > 0
        }
    finally:
        probe.close()
    if trimmed and not accept_partial:
        where = ", ".join(f"{p} starts at {o}" for p, o in sorted(trimmed.items()))
        raise RebuildRefusedError(
            f"topic {topic!r} no longer holds its whole history ({where}): a rebuild would "
            "lose what retention deleted; pass --accept-partial to rebuild from what is left"
        )


def _swap_in(
    scratch: psycopg.Connection, live: psycopg.Connection, summary_group: str, live_group: str
) -> None:
    """Every table of the scratch index replaces the live one's, in one live transaction."""
    tables = [
        name
        for (name,) in live.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'kvledger' ORDER BY tablename"
        )
    ]
    with live.transaction():
        # One TRUNCATE takes every table's lock before anything changes (readers wait for
        # the swap, then see the new index).
        live.execute("TRUNCATE " + ", ".join(f"kvledger.{t}" for t in tables) + " RESTART IDENTITY")
        for table in tables:
            source = scratch.cursor().copy(f"COPY kvledger.{table} TO STDOUT (FORMAT BINARY)")
            target = live.cursor().copy(f"COPY kvledger.{table} FROM STDIN (FORMAT BINARY)")
            with source as out, target as inp:
                for chunk in out:
                    inp.write(chunk)
        # The rebuild's offsets are the live group's from now on.
        live.execute(
            "UPDATE kvledger.consumer_offsets SET consumer_group = %s WHERE consumer_group LIKE %s",
            (live_group, summary_group + "%"),
        )
        for table, column in live.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'kvledger' AND column_default LIKE 'nextval%%'"
        ).fetchall():
            live.execute(
                f"SELECT setval(pg_get_serial_sequence('kvledger.{table}', %s), "
                f"coalesce((SELECT max({column}) FROM kvledger.{table}), 0) + 1, false)",
                (column,),
            )
