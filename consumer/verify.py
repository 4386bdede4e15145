"""Check the index against the log, and rebuild it from the log.

verify: replay the topic from its beginning into a scratch database, stopping exactly at the
live index's stored offsets, then compare every table (minus wall-clock columns). Declared
group specs are copied first (they are operator input, not in the log). Operator replays
of rejected events are not in the log either, so they show up as differences. Where the
live index's retention has dropped rows, both sides are compared within its retained
windows only (:func:`window_filters`), and the result says how many rows that left out.

rebuild: replace the live index with one rebuilt from the topic (declared specs kept).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import psycopg
import sqlalchemy as sa

from kvledger.consumer import retention
from kvledger.consumer.applier import stored_offsets
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect, create_database, drop_database, migrate
from kvledger.consumer.service import IndexConsumer
from kvledger.consumer.store.pg_state import load_specs, upsert_group_specs
from kvledger.consumer.store.tables import COMPARED
from kvledger.consumer.summary import RunSummary
from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, admin_settings

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

# Every compared table's columns (wall-clock ones left out), from the one table list.
COLUMNS: Mapping[str, str] = {name: ", ".join(t.compared) for name, t in COMPARED.items()}


def _value(v: object) -> object:
    if isinstance(v, memoryview):
        return bytes(v)
    if isinstance(v, list):
        return tuple(v)
    return v


def window_filters(windows: Mapping[str, datetime]) -> dict[str, tuple[str, tuple[object, ...]]]:
    """Per table, the rows a comparison covers when the live index has retained windows
    (consumer/retention.py): the same condition on both sides, so what retention dropped
    from one is left out of the other. Each is SQL over the table as ``t``, with parameters.

    - history: open intervals, and those that ended at or after its window start (an
      interval retention dropped was closed, so ended, before that);
    - the audit log: messages whose event time is inside its window; a rejection: the same,
      through its message's audit row;
    - blocks: held ones, those named by a compared interval, and those last stored at or
      after the last block expiry's cut-off;
    - engines' lives (``lifecycle_events``): those at or after its window start, and each
      source's newest of each kind (which retention keeps).
    """
    out: dict[str, tuple[str, tuple[object, ...]]] = {}
    history = windows.get("residency_history")
    named = "true"
    named_args: tuple[object, ...] = ()
    if history is not None:
        out["residency_history"] = ("t.removed_at IS NULL OR t.removed_at >= %s", (history,))
        named, named_args = "h.removed_at IS NULL OR h.removed_at >= %s", (history,)
    if (audit := windows.get("events")) is not None:
        out["events"] = ("t.event_time >= %s", (audit,))
    if (rejected := windows.get("rejected_events")) is not None:
        out["rejected_events"] = (
            "EXISTS (SELECT 1 FROM kvledger.events e WHERE e.kafka_topic = t.kafka_topic "
            "AND e.kafka_partition = t.kafka_partition AND e.kafka_offset = t.kafka_offset "
            "AND e.event_time >= %s)",
            (rejected,),
        )
    if (lives := windows.get("lifecycle_events")) is not None:
        out["lifecycle_events"] = (
            "t.event_time >= %s OR NOT EXISTS (SELECT 1 FROM kvledger.lifecycle_events n "
            "WHERE n.source = t.source AND n.kind = t.kind AND n.event_time > t.event_time)",
            (lives,),
        )
    if (blocks := windows.get("blocks")) is not None:
        out["blocks"] = (
            "t.last_seen >= %s OR EXISTS (SELECT 1 FROM kvledger.residencies r "
            "WHERE r.model = t.model AND r.group_idx = t.group_idx AND r.block_hash = t.block_hash)"
            " OR EXISTS (SELECT 1 FROM kvledger.residency_history h WHERE h.model = t.model "
            f"AND h.group_idx = t.group_idx AND h.block_hash = t.block_hash AND ({named}))",
            (blocks, *named_args),
        )
    return out


def dump(
    conn: psycopg.Connection,
    filters: Mapping[str, tuple[str, tuple[object, ...]]] | None = None,
) -> dict[str, Counter[tuple[object, ...]]]:
    """Every table as a multiset of rows (wall-clock columns left out), only the rows each
    filter (:func:`window_filters`) covers."""
    out = {}
    for table, cols in COLUMNS.items():
        where, args = (filters or {}).get(table, ("true", ()))
        rows = conn.execute(f"SELECT {cols} FROM kvledger.{table} t WHERE {where}", args).fetchall()
        out[table] = Counter(tuple(_value(v) for v in row) for row in rows)
    return out


def left_out(
    conn: psycopg.Connection, filters: Mapping[str, tuple[str, tuple[object, ...]]]
) -> dict[str, int]:
    """Per filtered table, the rows outside what the comparison covers."""
    out = {}
    for table, (where, args) in filters.items():
        row = conn.execute(
            f"SELECT count(*) FROM kvledger.{table} t WHERE NOT coalesce({where}, false)", args
        ).fetchone()
        out[table] = int(row[0]) if row else 0
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


@dataclass(frozen=True)
class _TopicLog:
    """The topic a verify or a rebuild replays: its broker, its name, the client's
    settings and the codec."""

    bootstrap: str
    topic: str
    kafka: Mapping[str, object] | None
    codec: Codec | None


def _replay_log(
    log: _TopicLog, scratch_url: str, group_prefix: str, stop_at: Mapping[int, int] | None = None
) -> RunSummary:
    """Apply the topic from its start into the index at ``scratch_url``, up to ``stop_at``
    (else to its end), under a Kafka group of its own (``group_prefix`` + a random suffix:
    joining the live group would take its partitions); rejections are stored, not re-sent."""
    return IndexConsumer(
        ConsumerConfig(
            bootstrap_servers=log.bootstrap,
            database_url=scratch_url,
            topic=log.topic,
            group_id=f"{group_prefix}{uuid.uuid4().hex[:8]}",
            dlq_topic=None,
            stop_at=stop_at,
            until_caught_up=not stop_at,
            batch_size=5000,
            batch_timeout_s=0.2,
            kafka=log.kafka or {},
        ),
        codec=log.codec,
    ).run()


@dataclass
class VerifyResult:
    differences: list[TableDiff]
    rebuilt: RunSummary
    targets: dict[int, int]
    rows: dict[str, int]
    # Where the live index's retention left each trimmed table, and the rows of each side
    # the comparison left out for that (table -> (live, rebuilt)).
    windows: dict[str, datetime] = field(default_factory=dict)
    not_compared: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Partitions whose log no longer starts at offset 0 (the topic's retention deleted
    # records): what only those said is in the live index and cannot be in the rebuild.
    log_starts: dict[int, int] = field(default_factory=dict)
    # The other topics the live index was fed from (its consumer offsets): a rebuild from
    # one topic cannot hold what they said.
    other_topics: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def verify(  # noqa: PLR0913 - `kvledger verify`'s options; the last three optional, by name
    bootstrap: str,
    live_url: str,
    topic: str,
    group: str,
    scratch_url: str | None = None,
    kafka: Mapping[str, object] | None = None,
    codec: Codec | None = None,
) -> VerifyResult:
    """Rebuild into a scratch database up to the live offsets and compare. The broker is
    asked first (within the start-up timeout): a broker that does not answer raises before
    anything is made, instead of a replay that waits for it for ever."""
    admin = _admin({**(kafka or {}), "bootstrap.servers": bootstrap})
    _trimmed(admin, topic)  # the probe; read again after the replay, which takes a while
    created = scratch_url is None
    if scratch_url is None:
        name = f"{sa.engine.make_url(live_url).database}_verify_{uuid.uuid4().hex[:8]}"
        scratch_url = create_database(live_url, name)
    try:
        migrate(scratch_url)
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            _copy_declared(live, scratch)
            targets = stored_offsets(live, group, topic)
            others = [
                str(t)
                for (t,) in live.execute(
                    "SELECT DISTINCT kafka_topic FROM kvledger.consumer_offsets "
                    "WHERE kafka_topic <> %s AND consumer_group NOT LIKE %s ORDER BY 1",
                    (topic, DECISIONS_GROUP),
                ).fetchall()
            ]
        log = _TopicLog(bootstrap, topic, kafka, codec)
        summary = _replay_log(log, scratch_url, f"{group}-verify-", stop_at=targets)
        starts = _trimmed(admin, topic)
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            windows = retention.windows(live)
            filters = window_filters(windows)
            a, b = dump(live, filters), dump(scratch, filters)
            out_live, out_rebuilt = left_out(live, filters), left_out(scratch, filters)
        return VerifyResult(
            diff(a, b),
            summary,
            targets,
            {t: sum(c.values()) for t, c in a.items()},
            windows,
            {t: (out_live[t], out_rebuilt[t]) for t in filters},
            starts,
            others,
        )
    finally:
        if created:
            drop_database(live_url, str(sa.engine.make_url(scratch_url).database))


def _admin(settings: Mapping[str, object]) -> AdminClient:
    from confluent_kafka.admin import AdminClient

    return AdminClient(client_logging({**admin_settings(settings), "log_level": 3}))


def _trimmed(admin: AdminClient, topic: str) -> dict[int, int]:
    """The partitions whose log no longer starts at offset 0, and where each starts now
    (the topic's retention deleted what came before)."""
    from kvledger.schemas.topics import partition_offsets

    starts = partition_offsets(admin, topic, earliest=True, timeout=STARTUP_TIMEOUT_S)
    return {p: o for p, o in sorted(starts.items()) if o > 0}


class RebuildRefusedError(KvledgerError):
    """A rebuild that would lose data or race a running consumer, refused with the reason."""


def rebuild(  # noqa: PLR0913 - `kvledger rebuild`'s options; the last three optional, by name
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
        log = _TopicLog(bootstrap, topic, kafka, codec)
        summary = _replay_log(log, scratch_url, f"{group}-rebuild-")
        with connect(live_url, autocommit=True) as live, connect(scratch_url, True) as scratch:
            _swap_in(scratch, live, summary_group=f"{group}-rebuild-", live_group=group)
        return summary
    finally:
        drop_database(live_url, name)


def _refuse_unsafe(
    settings: Mapping[str, object], topic: str, group: str, accept_partial: bool
) -> None:
    from confluent_kafka import KafkaException

    admin = _admin(settings)
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
    trimmed = _trimmed(admin, topic)
    if trimmed and not accept_partial:
        where = ", ".join(f"{p} starts at {o}" for p, o in trimmed.items())
        raise RebuildRefusedError(
            f"topic {topic!r} no longer holds its whole history ({where}): a rebuild would "
            "lose what retention deleted; pass --accept-partial to rebuild from what is left"
        )


# The offsets of a decisions topic are kept under '<group>:decisions'.
DECISIONS_GROUP = "%:decisions"
# The live index's own bookkeeping of its partitions and retention, and the routing
# decisions recorded from their own topic: not rebuilt from the events topic.
_KEPT_ON_SWAP = (
    "time_partitions",
    "retention_settings",
    "retained_windows",
    "decisions",
    "rejected_decisions",
)


def _swap_in(
    scratch: psycopg.Connection, live: psycopg.Connection, summary_group: str, live_group: str
) -> None:
    """Every table of the scratch index replaces the live one's, in one live transaction
    (a partitioned table's rows go through its parent into the live index's partitions; the
    live index keeps its own partitions, interval and retained windows)."""
    tables = [
        name
        for (name,) in live.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'kvledger' AND c.relkind IN ('r', 'p') AND NOT c.relispartition "
            "AND c.relname <> ALL(%s) ORDER BY c.relname",
            (list(_KEPT_ON_SWAP),),
        )
    ]
    # The decisions topic's offsets (consumer/decision_records.py) stay the live's, as the
    # decisions themselves do.
    other_offsets = live.execute(
        "SELECT consumer_group, kafka_topic, kafka_partition, next_offset "
        "FROM kvledger.consumer_offsets WHERE consumer_group LIKE %s",
        (DECISIONS_GROUP,),
    ).fetchall()
    with live.transaction():
        # One TRUNCATE takes every table's lock before anything changes (readers wait for
        # the swap, then see the new index).
        live.execute("TRUNCATE " + ", ".join(f"kvledger.{t}" for t in tables) + " RESTART IDENTITY")
        for table in tables:
            source = scratch.cursor().copy(
                f"COPY (SELECT * FROM kvledger.{table}) TO STDOUT (FORMAT BINARY)"
            )
            target = live.cursor().copy(f"COPY kvledger.{table} FROM STDIN (FORMAT BINARY)")
            with source as out, target as inp:
                for chunk in out:
                    inp.write(chunk)
        live.cursor().executemany(
            "INSERT INTO kvledger.consumer_offsets (consumer_group, kafka_topic, "
            "kafka_partition, next_offset) VALUES (%s, %s, %s, %s)",
            other_offsets,
        )
        # The rebuild's offsets are the live group's from now on.
        live.execute(
            "UPDATE kvledger.consumer_offsets SET consumer_group = %s WHERE consumer_group LIKE %s",
            (live_group, summary_group + "%"),
        )
        for table, column in live.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'kvledger' AND column_default LIKE 'nextval%%' "
            "AND table_name = ANY(%s)",
            (tables,),
        ).fetchall():
            live.execute(
                f"SELECT setval(pg_get_serial_sequence('kvledger.{table}', %s), "
                f"coalesce((SELECT max({column}) FROM kvledger.{table}), 0) + 1, false)",
                (column,),
            )
