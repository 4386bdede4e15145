"""`kvledger migrate | consume | groups | dlq`: the consumer side's commands."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from kvledger import settings
from kvledger.consumer import admin
from kvledger.consumer.config import DEFAULT_DLQ_TOPIC, DEFAULT_GROUP, ConsumerConfig
from kvledger.consumer.db import connect, migrate
from kvledger.consumer.service import IndexConsumer
from kvledger.consumer.summary import RunSummary
from kvledger.process import freeze_startup_objects
from kvledger.schemas.events import SPEC_KINDS, GroupSpec
from kvledger.tables import print_table

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")


def _log_args(p: argparse.ArgumentParser, group_help: str) -> None:
    """The index's database and the log it is built from: broker, client and registry
    settings, topic, consumer group (consume, verify and rebuild take the same)."""
    _db_arg(p)
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (else $KVLEDGER_KAFKA_BOOTSTRAP)")
    settings.add_kafka_args(p)
    settings.add_registry_args(p)
    p.add_argument("--topic", default="kv-events", help="the Kafka topic of events")
    p.add_argument("--consumer-group", dest="group", default=DEFAULT_GROUP, help=group_help)


def add_parsers(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("migrate", help="create or upgrade the index schema (alembic)")
    _db_arg(p)
    p.add_argument("--revision", default="head", help="the Alembic revision to reach")
    p.set_defaults(run=_migrate)

    p = subparsers.add_parser("consume", help="materialize the topic into the index")
    _log_args(p, "the Kafka consumer group (its offsets live in the index)")
    p.add_argument("--dlq-topic", default=DEFAULT_DLQ_TOPIC, help="the dead-letter topic")
    p.add_argument(
        "--dlq-replication-factor", type=int, default=-1,
        help="replication factor when the consumer creates the dead-letter topic (-1: the "
        "cluster's default)",
    )  # fmt: skip
    p.add_argument(
        "--max-batch-retries", type=int, default=5,
        help="tries of a batch failing with a transient-looking error on a working "
        "connection before its failing message is isolated and rejected",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=5000, help="messages per transaction")
    p.add_argument("--batch-timeout", type=float, default=0.5, help="seconds")
    p.add_argument(
        "--until-caught-up",
        action="store_true",
        help="exit 0 once the stored offsets reach the partitions' end offsets",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--metrics-host", default="127.0.0.1",
        help="interface for the metrics (0.0.0.0 to reach them from other hosts)",
    )  # fmt: skip
    p.add_argument(
        "--group-instance-id",
        help="static group membership id: a restart with the same id resumes at once",
    )
    p.add_argument("--no-migrate", action="store_true", help="do not run migrations first")
    p.set_defaults(run=_consume)

    g = subparsers.add_parser("groups", help="declare or list KV-cache group specs")
    gs = g.add_subparsers(dest="groups_command", required=True)
    p = gs.add_parser("declare", help="declare a group's spec (wins over announcements)")
    _db_arg(p)
    p.add_argument("--model", required=True, help="the model the group belongs to")
    p.add_argument(
        "--group", type=int, required=True, dest="group_idx", help="the KV-cache group index"
    )
    p.add_argument(
        "--kind", default="full_attention", choices=sorted(SPEC_KINDS), help="the spec kind"
    )
    p.add_argument("--block-size", type=int, required=True, help="tokens per KV block")
    p.add_argument("--hash-block-size", type=int, help="defaults to the block size")
    p.add_argument("--sliding-window", type=int, help="the window, for sliding-window kinds")
    p.set_defaults(run=_groups_declare)
    p = gs.add_parser("list", help="list group specs")
    _db_arg(p)
    p.add_argument("--json", action="store_true", help="one JSON object per group, as a list")
    p.set_defaults(run=_groups_list)

    d = subparsers.add_parser("dlq", help="inspect or replay rejected events")
    ds = d.add_subparsers(dest="dlq_command", required=True)
    p = ds.add_parser("list", help="rejections by reason, and the latest rows")
    _db_arg(p)
    p.add_argument("--reason", help="only rejections with this reason code")
    p.add_argument("--limit", type=int, default=20, help="rows to show")
    p.add_argument("--json", action="store_true", help='{"summary": [...], "rows": [...]} as JSON')
    p.set_defaults(run=_dlq_list)
    p = ds.add_parser("replay", help="re-apply pending rejected events (idempotent)")
    _db_arg(p)
    p.add_argument("--reason", help="only this reason (needed for duplicate and stale_epoch)")
    settings.add_registry_args(p)
    p.set_defaults(run=_dlq_replay)


def _migrate(args: argparse.Namespace) -> int:
    url = settings.database_url(args.database_url)
    migrate(url, args.revision)
    print(f"index schema at revision {args.revision}")
    return 0


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
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        group_instance_id=args.group_instance_id,
        dlq_replication_factor=args.dlq_replication_factor,
        kafka=settings.kafka_settings(args),
        max_batch_retries=args.max_batch_retries,
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


def _consume(args: argparse.Namespace) -> int:
    config = consumer_config(args)
    if not args.no_migrate:
        migrate(config.database_url)
    codec = settings.codec(args, config.topic, writer=False)
    service = IndexConsumer(config, codec=codec, progress=terminal_progress)

    def on_signal(signum: int, frame: Any) -> None:
        logger.info("signal %d: finishing the current batch", signum)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    freeze_startup_objects()
    summary = service.run()
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


def _groups_declare(args: argparse.Namespace) -> int:
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
    print(f"declared {spec}")
    return 0


def _groups_list(args: argparse.Namespace) -> int:
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        rows = admin.list_groups(conn)
    header = ["model", "group", "kind", "block", "hash", "window", "origin", "by", "updated"]
    if args.json:
        keys = ["model", "group_idx", "kind", "block_size", "hash_block_size", "sliding_window",
                "origin", "announced_by", "updated_at"]  # fmt: skip
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], default=str))
        return 0
    print_table(header, rows)
    return 0


def _dlq_list(args: argparse.Namespace) -> int:
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        summary = admin.dlq_summary(conn)
        rows = admin.dlq_rows(conn, args.reason, args.limit)
    if args.json:
        totals = ["reason", "pending", "replayed", "first_seen", "last_seen"]
        keys = ["id", "kafka_topic", "kafka_partition", "kafka_offset", "source", "reason",
                "detail", "first_seen", "replayed_at"]  # fmt: skip
        print(json.dumps(
            {"summary": [dict(zip(totals, r, strict=True)) for r in summary],
             "rows": [dict(zip(keys, r, strict=True)) for r in rows]},
            default=str,
        ))  # fmt: skip
        return 0
    print_table(["reason", "pending", "replayed", "first", "last"], summary)
    print()
    header = ["id", "topic", "part", "offset", "source", "reason", "detail", "seen", "replayed"]
    print_table(header, rows)
    return 0


def _dlq_replay(args: argparse.Namespace) -> int:
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        codec = settings.codec(args, "", writer=False)  # reads: registry framing by id
        result = admin.replay(conn, reason=args.reason, codec=codec)
    print(f"replayed {result.replayed} of {result.considered} pending rejected events")
    for reason, count in sorted(result.still_rejected.items()):
        print(f"  still rejected {reason}: {count}")
    return 0


def add_reliability_parsers(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="rebuild the index from the topic into a scratch database and diff it"
    )
    _log_args(p, "the live index's consumer group")
    p.add_argument("--scratch-url", help="an empty database to rebuild into (else created)")
    p.add_argument("--show", type=int, default=5, help="example rows per difference")
    p.add_argument(
        "--json", action="store_true",
        help='{"ok", "rebuilt_messages", "targets", "rows", "differences"} as JSON',
    )  # fmt: skip
    p.set_defaults(run=_verify)

    p = subparsers.add_parser(
        "rebuild", help="replace the live index with one rebuilt from the topic"
    )
    _log_args(p, "the live index's consumer group")
    p.add_argument("--yes", action="store_true", help="confirm: the live index is replaced")
    p.add_argument(
        "--accept-partial", action="store_true",
        help="rebuild even when retention has deleted the start of the topic (the rebuilt "
        "index then lacks what only those messages said)",
    )  # fmt: skip
    p.set_defaults(run=_rebuild)


def _verify(args: argparse.Namespace) -> int:
    from kvledger.consumer.verify import verify

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
        print(json.dumps({
            "ok": result.ok, "rebuilt_messages": result.rebuilt.messages,
            "targets": {str(p): o for p, o in sorted(result.targets.items())},
            "rows": result.rows,
            "differences": [
                {"table": d.table, "only_live": len(d.only_live),
                 "only_rebuilt": len(d.only_rebuilt)}
                for d in result.differences
            ],
        }))  # fmt: skip
        return 0 if result.ok else 1
    targets = ", ".join(f"{p}@{o}" for p, o in sorted(result.targets.items())) or "(none)"
    print(f"rebuilt {result.rebuilt.messages} messages from {args.topic} up to {targets}")
    if result.ok:
        rows = ", ".join(f"{t} {n}" for t, n in result.rows.items())
        print(f"verify: OK — the index equals the rebuild ({rows})")
        return 0
    print("verify: DIFFERENT")
    for d in result.differences:
        print(
            f"  {d.table}: {len(d.only_live)} row(s) only in the live index, "
            f"{len(d.only_rebuilt)} only in the rebuild"
        )
        for row in d.only_live[: args.show]:
            print(f"    - live    {row!r:.300}")
        for row in d.only_rebuilt[: args.show]:
            print(f"    + rebuilt {row!r:.300}")
    return 1


def _rebuild(args: argparse.Namespace) -> int:
    from kvledger.consumer.verify import RebuildRefusedError, rebuild

    if not args.yes:
        print(
            "kvledger: rebuild replaces the live index; stop its consumers, then pass --yes",
            file=sys.stderr,
        )
        return 2
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
