"""`kvledger status`: the index at a glance. Its database and schema, its sources by state,
the blocks they hold by tier, the rejected events waiting, and, given a broker, how far the
consumer group is behind the topic. Each line says what to run for more. Exit 0 when
nothing needs an operator, 1 when something does (no schema, a rejection pending, a source
that changed model); a consumer behind is said, not alarmed (it catches up)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from kvledger import settings
from kvledger.consumer.admin import dlq_summary, list_sources
from kvledger.consumer.db import connect
from kvledger.consumer.decision_records import summary as decision_summary


@dataclass
class Status:
    """What `kvledger status` shows (also its --json)."""

    database: str
    schema: str | None
    sources: dict[str, int] = field(default_factory=dict)  # state -> count
    held: dict[str, int] = field(default_factory=dict)  # tier -> residencies
    rejected_pending: dict[str, int] = field(default_factory=dict)  # reason -> pending
    model_changes: list[str] = field(default_factory=list)
    topic: str | None = None
    consumer_group: str | None = None
    behind: int | None = None  # messages the group has not applied (None: not asked)
    partitions: int | None = None
    # Routing decisions recorded in the last hour (kvledger.decision_funnel's sums).
    decisions: dict[str, int] = field(default_factory=dict)
    # The decision recorder's topic and how far behind it is (None: it has recorded none).
    decisions_topic: str | None = None
    recorder_behind: int | None = None
    # Readers behind the log that have made no progress for --stalled-after seconds.
    stalled: list[str] = field(default_factory=list)
    # Why the events topic cannot be read (it does not exist), when it cannot.
    missing_topic: str | None = None
    # Why the lag could not be read (the broker did not answer), when it could not.
    broker_error: str | None = None
    # Why the group reads as all behind: it never consumed the topic others did.
    unknown_group: str | None = None

    @property
    def attention(self) -> list[str]:
        """What an operator should look at (empty: nothing)."""
        out = []
        if self.schema is None:
            out.append("the index schema is missing: run `kvledger migrate`")
        if pending := sum(self.rejected_pending.values()):
            out.append(f"{pending} rejected event(s) pending: `kvledger dlq list`")
        out += [
            f"source {s} changed model: give each model its own source id"
            for s in self.model_changes
        ]
        if self.missing_topic is not None:
            out.append(self.missing_topic)
        if self.broker_error is not None:
            out.append(self.broker_error)
        if self.unknown_group is not None:
            out.append(self.unknown_group)
        return out + self.stalled


def gather(args: argparse.Namespace) -> Status:
    url = settings.database_url(args.database_url)
    where = sa.engine.make_url(url)
    window = timedelta(seconds=args.silent_after) if args.silent_after else None
    status = Status(f"{where.database} on {where.host or 'a local socket'}:{where.port}", None)
    with connect(url, autocommit=True) as conn:
        found = conn.execute("SELECT to_regclass('kvledger_migrations.version')").fetchone()
        if found is None or found[0] is None:
            return status
        version = conn.execute("SELECT version_num FROM kvledger_migrations.version").fetchone()
        status.schema = str(version[0]) if version else "?"
        sources = list_sources(conn, window)
        for s in sources:
            status.sources[s.state] = status.sources.get(s.state, 0) + 1
            for tier, n in s.held.items():
                status.held[tier] = status.held.get(tier, 0) + n
        status.model_changes = [s.source for s in sources if s.previous_model is not None]
        found = conn.execute("SELECT to_regclass('kvledger.decision_funnel')").fetchone()
        if found is not None and found[0] is not None:
            since = datetime.now(UTC) - timedelta(hours=1)
            status.decisions = decision_summary(conn, since)
        for reason, pending, *_ in dlq_summary(conn):
            if int(str(pending)):
                status.rejected_pending[str(reason)] = int(str(pending))
        if getattr(args, "bootstrap", None) or settings.from_env(settings.ENV_KAFKA):
            from confluent_kafka import KafkaException

            try:
                _lag(conn, args, status)
            except KafkaException as exc:  # the index's summary still stands
                from kvledger.cli import _one_line

                status.broker_error = f"Kafka: {_one_line(exc)[1]}"
    return status


def _other_groups(conn: Any, group: str, topic: str) -> str | None:
    """Why ``group`` reads as all behind ``topic`` when other groups have consumed it: it
    stored no offsets there (a typo of --consumer-group); None when no group has (nothing
    consumed yet)."""
    found = [
        str(g)
        for (g,) in conn.execute(
            "SELECT DISTINCT consumer_group FROM kvledger.consumer_offsets "
            "WHERE kafka_topic = %s AND consumer_group NOT LIKE '%%:decisions' ORDER BY 1",
            (topic,),
        ).fetchall()
    ]
    if not found:
        return None
    return (
        f"consumer group {group} has stored no offsets for {topic}: the index was fed by "
        f"{', '.join(found[:10])} (pass --consumer-group)"
    )


def _lag(conn: Any, args: argparse.Namespace, status: Status) -> None:
    """How far the index consumer (and the decision recorder, when it has recorded any)
    is behind the log, and which of them is stalled: behind, with no offsets stored for
    ``--stalled-after`` seconds."""
    from kvledger.schemas.topic_check import missing_topic
    from kvledger.schemas.topics import STARTUP_TIMEOUT_S

    group = args.consumer_group
    status.topic, status.consumer_group = args.topic, group
    kafka = {**settings.kafka_settings(args), "bootstrap.servers": settings.kafka_bootstrap(args)}
    status.missing_topic = missing_topic(kafka, args.topic, STARTUP_TIMEOUT_S)
    if status.missing_topic is not None:
        return
    rows = conn.execute(
        "SELECT consumer_group, kafka_topic, kafka_partition, next_offset, "
        "extract(epoch FROM now() - updated_at) FROM kvledger.consumer_offsets "
        "WHERE consumer_group = %s OR (consumer_group = %s AND kafka_topic <> %s)",
        (group, f"{group}:decisions", args.topic),
    ).fetchall()
    readers: dict[tuple[str, str], dict[int, tuple[int, float]]] = {(group, args.topic): {}}
    for g, topic, partition, offset, age in rows:
        readers.setdefault((g, topic), {})[int(partition)] = (int(offset), float(age))
    if not readers[(group, args.topic)]:
        status.unknown_group = _other_groups(conn, group, args.topic)
    stalled_after = getattr(args, "stalled_after", None)
    for (g, topic), stored in readers.items():
        if g == group and topic != args.topic:
            continue  # another topic this group once read
        ends = _log_ends(args, topic)
        behind = sum(max(0, end - stored.get(p, (0, 0.0))[0]) for p, end in ends.items())
        idle = min((age for _, age in stored.values()), default=None)
        if g == group:
            status.partitions, status.behind = len(ends), behind
            what, run = f"the consumer (group {g} on {topic})", "kvledger consume"
        else:
            status.decisions_topic, status.recorder_behind = topic, behind
            what = f"the decision recorder (on {topic})"
            run = f"kvledger consume --decisions-topic {topic}"
        if behind and idle is not None and stalled_after is not None and idle > stalled_after:
            status.stalled.append(
                f"{what} is {behind:,} message(s) behind and has stored nothing for "
                f"{idle:.0f} s: is `{run}` running? Its log says why it stopped"
            )


def _funnel(d: dict[str, int]) -> str:
    """Of the reuse available, what routing captured and the engines delivered."""
    available = d["available_blocks"]
    if not available:
        return "no reuse was available"
    captured = f"captured {d['captured_blocks'] / available:.0%} of {available:,} blocks available"
    if not d["delivered_known"]:
        return captured
    return f"{captured}, delivered {d['delivered_blocks']:,} (where the prompt's hashes are known)"


def _log_ends(args: argparse.Namespace, topic: str) -> dict[int, int]:
    from confluent_kafka.admin import AdminClient

    from kvledger.schemas.kafka_log import client_logging
    from kvledger.schemas.topics import admin_settings, partition_offsets

    kafka = {**settings.kafka_settings(args), "bootstrap.servers": settings.kafka_bootstrap(args)}
    admin = AdminClient(client_logging({**admin_settings(kafka), "log_level": 3}))
    return partition_offsets(admin, topic, timeout=10)


def run(args: argparse.Namespace) -> int:
    status = gather(args)
    if args.json:
        out: dict[str, Any] = {**status.__dict__, "attention": status.attention}
        print(json.dumps(out, indent=2))
        return 1 if status.attention else 0
    print(
        f"index      {status.database}: "
        + (f"schema {status.schema}" if status.schema else "no kvledger schema (kvledger migrate)")
    )
    if status.schema is not None:
        states = ", ".join(f"{n} {state}" for state, n in sorted(status.sources.items()))
        print(
            f"sources    {sum(status.sources.values())}"
            + (f" ({states})" if states else "")
            + ": kvledger sources"
        )
        tiers = "  ".join(f"{t} {status.held.get(t, 0):,}" for t in ("GPU", "CPU", "STORAGE"))
        print(f"held       {tiers} (blocks held, by tier)")
        pending = sum(status.rejected_pending.values())
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(status.rejected_pending.items()))
        print(f"rejected   {pending} pending" + (f" ({reasons})" if reasons else ""))
        if n := status.decisions.get("decisions"):
            print(f"routing    {n:,} decision(s) in the last hour: {_funnel(status.decisions)}")
        if n := status.decisions.get("unreported"):
            offered = status.decisions.get("unreported_available_blocks", 0)
            print(
                f"answers    {n:,} with no choice reported (Dynamo's /query) in the last "
                f"hour, {offered:,} blocks available"
            )
    if status.behind is not None:
        print(
            f"consumer   group {status.consumer_group} on {status.topic} "
            f"({status.partitions} partitions): {status.behind:,} message(s) behind"
        )
    if status.recorder_behind is not None:
        print(
            f"recorder   decisions on {status.decisions_topic}: "
            f"{status.recorder_behind:,} record(s) behind"
        )
    for line in status.attention:
        print(f"attention  {line}")
    return 1 if status.attention else 0
