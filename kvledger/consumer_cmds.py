"""`kvledger migrate | consume | groups | dlq | verify | rebuild`: the consumer side's
commands (their arguments: kvledger.arguments)."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import signal
import sys
from typing import Any

from kvledger import settings
from kvledger.consumer import admin
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect, current_revision, migrate
from kvledger.consumer.retention_policy import DurationError, Retention, show_duration
from kvledger.consumer.service import IndexConsumer
from kvledger.consumer.summary import RunSummary
from kvledger.process import collect_less_often, freeze_startup_objects
from kvledger.schemas.events import GroupSpec
from kvledger.schemas.replication import warn_under_replicated_later
from kvledger.tables import print_table

logger = logging.getLogger(__name__)


def migrate_cmd(args: argparse.Namespace) -> int:
    url = settings.database_url(args.database_url)
    interval = args.partition_interval
    if interval is not None and interval.total_seconds() < 1:
        print(
            f"kvledger: --partition-interval {show_duration(interval)}: partitions span at "
            "least 1s",
            file=sys.stderr,
        )
        return 2
    before = current_revision(url)
    migrate(url, args.revision)
    after = current_revision(url)
    if before == after:
        print(f"index schema already at revision {after} ({args.revision}): nothing to do")
    else:
        print(f"index schema migrated from revision {before or '(none)'} to {after}")
    if interval is not None:
        from kvledger.consumer import retention

        with connect(url, autocommit=True) as conn:
            made = retention.set_partition_interval(conn, interval)
        print(f"partition interval {show_duration(interval)}: {made} partitions made ahead at it")
    return 0


def _retention(args: argparse.Namespace) -> Retention:
    return Retention(args.history_retention, args.audit_retention, args.block_retention)


def _check_retention(url: str, policy: Retention) -> None:
    """A retention shorter than the index's partition interval: a usage error (exit 2)."""
    from kvledger.consumer import retention

    with connect(url, autocommit=True) as conn:
        interval = retention.partition_interval(conn)
    try:
        policy.check(interval)
    except DurationError as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def consumer_config(args: argparse.Namespace) -> ConsumerConfig:
    return ConsumerConfig(
        bootstrap_servers=settings.kafka_bootstrap(args),
        database_url=settings.database_url(args.database_url),
        topic=args.topic,
        group_id=args.group,
        dlq_topic=args.dlq_topic,
        batch_size=args.batch_size,
        batch_timeout_s=args.batch_timeout,
        until_caught_up=args.until_caught_up,
        plan_ahead=args.plan_ahead,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        group_instance_id=args.group_instance_id,
        dlq_replication_factor=args.dlq_replication_factor,
        kafka=settings.kafka_settings(args),
        max_batch_retries=args.max_batch_retries,
        retention=_retention(args),
        retention_every_s=args.retention_every,
    )


def terminal_progress(summary: RunSummary, lag: int) -> None:
    if not sys.stderr.isatty():
        return
    sys.stderr.write(
        f"\rconsumed {summary.messages:,} messages: {summary.applied:,} applied, "
        f"{summary.rejected:,} rejected, {summary.duplicates:,} duplicate; "
        f"{summary.block_events:,} block events; lag {lag:,}   "
    )
    sys.stderr.flush()


def _missing_topic(config: ConsumerConfig) -> str | None:
    """Why ``--until-caught-up`` on this topic would end at once having read nothing (the
    topic does not exist: a typo), naming the topics that do; None when it exists or the
    broker cannot say (the consumer then reports the broker itself)."""
    from kvledger.schemas.topic_check import missing_topic
    from kvledger.schemas.topics import STARTUP_TIMEOUT_S

    kafka = {**config.kafka, "bootstrap.servers": config.bootstrap_servers}
    why = missing_topic(kafka, config.topic, STARTUP_TIMEOUT_S)
    return None if why is None else f"kvledger consume: {why}"


def _refuse_missing_topic(args: argparse.Namespace, command: str) -> None:
    """Exit with one line when ``args.topic`` does not exist on the broker."""
    from kvledger.schemas.topic_check import missing_topic
    from kvledger.schemas.topics import STARTUP_TIMEOUT_S

    kafka = {**settings.kafka_settings(args), "bootstrap.servers": settings.kafka_bootstrap(args)}
    if (why := missing_topic(kafka, args.topic, STARTUP_TIMEOUT_S)) is not None:
        raise SystemExit(f"kvledger {command}: {why}")


def consume(args: argparse.Namespace) -> int:
    config = consumer_config(args)
    if config.until_caught_up and (missing := _missing_topic(config)) is not None:
        raise SystemExit(missing)
    topics = [config.topic, config.dead_letter_topic, getattr(args, "decisions_topic", None)]
    warn_under_replicated_later(config.bootstrap_servers, config.kafka, filter(None, topics))
    if not args.no_migrate:
        migrate(config.database_url)
    assert config.retention is not None
    _check_retention(config.database_url, config.retention)
    codec = settings.codec(args, config.topic, writer=False)
    service = IndexConsumer(config, codec=codec, progress=terminal_progress)

    def on_signal(signum: int, frame: Any) -> None:
        logger.info("signal %d: finishing the current batch", signum)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    recorder = None
    if getattr(args, "decisions_topic", None):
        from kvledger.consumer.decision_records import DecisionRecorder

        recorder = DecisionRecorder(
            config.database_url,
            config.bootstrap_servers,
            args.decisions_topic,
            config.group_id,
            kafka=dict(config.kafka or {}),
        )
        recorder.start()
    freeze_startup_objects()
    collect_less_often()
    try:
        summary = service.run()
    finally:
        if recorder is not None:
            recorder.stop()
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    print(
        f"consumed {summary.messages} messages in {summary.batches} batches "
        f"({summary.seconds:.1f} s): {summary.applied} applied, {summary.rejected} rejected, "
        f"{summary.duplicates} duplicate, {summary.block_events} block events"
    )
    for reason, count in sorted(summary.rejected_by_reason.items()):
        print(f"  rejected {reason}: {count}")
    return 0


def groups_declare(args: argparse.Namespace) -> int:
    spec = GroupSpec(
        model=args.model,
        group_idx=args.group_idx,
        kind=args.kind,
        block_size=args.block_size,
        hash_block_size=args.hash_block_size or args.block_size,
        sliding_window=args.sliding_window,
    )
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        try:
            admin.declare_group(conn, spec)
        except admin.InvalidSpecError as exc:
            print(f"kvledger: invalid spec: {exc}", file=sys.stderr)
            return 2
    hashes = (
        f", {spec.hash_block_size}-token hashes" if spec.hash_block_size != spec.block_size else ""
    )
    window = f", window {spec.sliding_window}" if spec.sliding_window is not None else ""
    print(
        f"declared group {spec.group_idx} of model {spec.model}: {spec.kind}, "
        f"{spec.block_size}-token blocks{hashes}{window} (wins over announcements)"
    )
    return 0


def groups_list(args: argparse.Namespace) -> int:
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        rows = admin.list_groups(conn)
    header = ["model", "group", "kind", "block", "hash", "window", "origin", "by", "updated"]
    if args.json:
        keys = [
            "model",
            "group_idx",
            "kind",
            "block_size",
            "hash_block_size",
            "sliding_window",
            "origin",
            "announced_by",
            "updated_at",
        ]
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], default=str))
        return 0
    print_table(header, rows)
    return 0


def _known_reason(command: str, reason: str | None) -> None:
    """A --reason no rejection can have (a typo) is refused, naming the codes there are."""
    from kvledger.consumer.core.validate import Reason

    codes = [r.value for r in Reason]
    if reason is not None and reason not in codes:
        close = difflib.get_close_matches(reason, codes, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SystemExit(
            f"kvledger dlq {command}: no reason code {reason!r}: {hint}the codes are "
            f"{', '.join(codes)}"
        )


def dlq_list(args: argparse.Namespace) -> int:
    _known_reason("list", args.reason)
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        summary = admin.dlq_summary(conn)
        rows = admin.dlq_rows(conn, args.reason, args.limit)
    if args.json:
        totals = ["reason", "pending", "replayed", "first_seen", "last_seen"]
        keys = [
            "id",
            "kafka_topic",
            "kafka_partition",
            "kafka_offset",
            "source",
            "reason",
            "detail",
            "first_seen",
            "replayed_at",
        ]
        print(
            json.dumps(
                {
                    "summary": [dict(zip(totals, r, strict=True)) for r in summary],
                    "rows": [dict(zip(keys, r, strict=True)) for r in rows],
                },
                default=str,
            )
        )
        return 0
    if not summary:
        print("no rejected events")
        return 0
    print_table(["reason", "pending", "replayed", "first", "last"], summary)
    if rows:
        print()
        header = ["id", "topic", "part", "offset", "source", "reason", "detail", "seen", "replayed"]
        print_table(header, rows)
    return 0


def dlq_replay(args: argparse.Namespace) -> int:
    _known_reason("replay", args.reason)
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        codec = settings.codec(args, "", writer=False)  # reads: registry framing by id
        result = admin.replay(conn, reason=args.reason, codec=codec)
    print(f"replayed {result.replayed} of {result.considered} pending rejected events")
    for reason, count in sorted(result.still_rejected.items()):
        print(f"  still rejected {reason}: {count}")
    return 0


def verify_cmd(args: argparse.Namespace) -> int:
    from kvledger.consumer.verify import describe_row, verify

    _refuse_missing_topic(args, "verify")

    result = verify(
        settings.kafka_bootstrap(args),
        settings.database_url(args.database_url),
        args.topic,
        args.group,
        args.scratch_url,
        kafka=settings.kafka_settings(args),
        codec=settings.codec(args, args.topic, writer=False),
    )
    if args.json:
        print(
            json.dumps(
                {
                    "ok": result.ok,
                    "rebuilt_messages": result.rebuilt.messages,
                    "targets": {str(p): o for p, o in sorted(result.targets.items())},
                    "rows": result.rows,
                    "retained_since": result.windows,
                    "log_starts": {str(p): o for p, o in result.log_starts.items()},
                    "other_topics": result.other_topics,
                    "not_compared": {
                        t: {"live": a, "rebuilt": b} for t, (a, b) in result.not_compared.items()
                    },
                    "differences": [
                        {
                            "table": d.table,
                            "only_live": len(d.only_live),
                            "only_rebuilt": len(d.only_rebuilt),
                        }
                        for d in result.differences
                    ],
                },
                default=str,
            )
        )
        return 0 if result.ok else 1
    targets = ", ".join(f"{p}@{o}" for p, o in sorted(result.targets.items())) or "(none)"
    print(f"rebuilt {result.rebuilt.messages} messages from {args.topic} up to {targets}")
    if result.log_starts:
        where = ", ".join(f"{p} at {o}" for p, o in result.log_starts.items())
        print(
            f"  the topic no longer starts at offset 0 ({where}): the topic's retention "
            "deleted those records, so what only they said cannot be rebuilt and shows as "
            "a difference"
        )
    for table, (live_rows, rebuilt_rows) in result.not_compared.items():
        print(
            f"  {table}: compared from {result.windows[table]} (the live index's retained "
            f"window); not compared: {live_rows} live and "
            f"{rebuilt_rows} rebuilt row(s) outside it"
        )
    if result.ok:
        rows = ", ".join(f"{t} {n}" for t, n in result.rows.items())
        print(f"verify: OK — the index equals the rebuild ({rows})")
        return 0
    print("verify: DIFFERENT")
    if result.other_topics:
        print(
            f"  the index was also fed from {', '.join(result.other_topics)} (its consumer "
            f"offsets): verify rebuilds from {args.topic} alone, so what those topics said "
            "shows as a difference; an index fed from several topics cannot be verified "
            "against one"
        )
    for d in result.differences:
        print(
            f"  {d.table}: {len(d.only_live)} row(s) only in the live index, "
            f"{len(d.only_rebuilt)} only in the rebuild"
        )
        for row in d.only_live[: args.show]:
            print(f"    - live    {describe_row(d.table, row)}")
        for row in d.only_rebuilt[: args.show]:
            print(f"    + rebuilt {describe_row(d.table, row)}")
    return 1


def rebuild_cmd(args: argparse.Namespace) -> int:
    from kvledger.consumer.verify import RebuildRefusedError, rebuild

    if not args.yes:
        print(
            "kvledger: rebuild replaces the live index; stop its consumers, then pass --yes",
            file=sys.stderr,
        )
        return 2
    _refuse_missing_topic(args, "rebuild")
    try:
        summary = rebuild(
            settings.kafka_bootstrap(args),
            settings.database_url(args.database_url),
            args.topic,
            args.group,
            accept_partial=args.accept_partial,
            kafka=settings.kafka_settings(args),
            codec=settings.codec(args, args.topic, writer=False),
        )
    except RebuildRefusedError as exc:
        print(f"kvledger rebuild: refused: {exc}", file=sys.stderr)
        return 2
    print(
        f"rebuilt the index from {summary.messages} messages: {summary.applied} applied, "
        f"{summary.rejected} rejected"
    )
    return 0


def retention_cmd(args: argparse.Namespace) -> int:
    """Where each table's retained rows start and its partitions; with --once, one pass."""
    from kvledger.consumer import retention

    url = settings.database_url(args.database_url)
    policy = _retention(args)
    _check_retention(url, policy)
    with connect(url, autocommit=True) as conn:
        report = retention.run_pass(conn, policy) if args.once else None
        state = retention.status(conn)
    if args.json:
        out: dict[str, Any] = {**state.as_json()}
        if report is not None:
            out["pass"] = report.as_json()
        print(json.dumps(out, default=str))
        return 0
    if report is not None:
        print(
            f"retention pass ({report.seconds:.2f} s): made {report.made} partitions, dropped "
            f"{len(report.dropped)}, deleted {report.blocks_deleted} blocks no one holds"
        )
        if report.skipped:
            print(f"  drops skipped: {report.skipped}")
    print(f"partition interval {show_duration(state.interval)}")
    rows: list[tuple[object, ...]] = [
        (table, t.partitions, t.first, t.last, state.windows.get(table, "everything"))
        for table, t in state.tables.items()
    ]
    rows.append(("blocks", "", "", "", state.windows.get("blocks", "everything")))
    print_table(["table", "partitions", "from", "to", "retained since"], rows)
    return 0
