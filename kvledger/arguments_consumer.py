"""The consumer side's commands' arguments: migrate, consume, retention, groups, dlq, verify
and rebuild (their code: kvledger.consumer_cmds)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvledger.consumer.retention_policy import duration_arg
from kvledger.options import add_registry_args, db_arg, log_args
from kvledger.parsers import COUNT, NON_NEGATIVE, PORT_OR_OFF, SECONDS, add, command
from kvledger.schemas.kinds import SPEC_KINDS

if TYPE_CHECKING:
    from kvledger.parsers import Subparsers


def _retention_args(p: argparse.ArgumentParser) -> None:
    """How long history, audit and blocks no one holds are kept (consume and retention)."""
    p.add_argument(
        "--history-retention",
        type=duration_arg,
        default="7d",
        metavar="D",
        help="keep residency history intervals this long after they closed",
    )
    p.add_argument(
        "--audit-retention",
        type=duration_arg,
        default="7d",
        metavar="D",
        help="keep the audit log (events) and rejected events this long",
    )
    p.add_argument(
        "--block-retention",
        type=duration_arg,
        default="1d",
        metavar="D",
        help="delete a block row this long after it was last stored, once no residency "
        "holds it and no retained history names it",
    )


def add_consumer(subparsers: Subparsers) -> None:  # noqa: PLR0915 - one statement per option
    extra = "consumer"
    p = add(subparsers, "migrate", extra, "create or upgrade the index schema (alembic)")
    db_arg(p)
    p.add_argument("--revision", default="head", help="the Alembic revision to reach")
    p.add_argument(
        "--partition-interval",
        type=duration_arg,
        metavar="D",
        help="the time span of each history and audit partition (90s, 10m, 1d; a new "
        "index starts at 1d); it applies after the newest partition in use",
    )
    p.set_defaults(run=command("consumer_cmds:migrate_cmd"))

    p = add(subparsers, "consume", extra, "materialize the topic into the index")
    log_args(p, "the Kafka consumer group (its offsets live in the index)")
    p.add_argument(
        "--dlq-topic",
        default="",
        help="the dead-letter topic (default: the topic's own, TOPIC.dlq: kv-events.dlq)",
    )
    p.add_argument(
        "--dlq-replication-factor",
        type=int,
        default=-1,
        help="replication factor when the consumer creates the dead-letter topic (-1: the "
        "cluster's default)",
    )
    p.add_argument(
        "--max-batch-retries",
        type=NON_NEGATIVE,
        default=5,
        help="tries of a batch failing with a transient-looking error on a working "
        "connection before its failing message is isolated and rejected",
    )
    p.add_argument("--batch-size", type=COUNT, default=5000, help="messages per transaction")
    p.add_argument(
        "--decisions-topic",
        metavar="TOPIC",
        help="also record the routing decisions `serve --memory --decisions-topic` writes "
        "there into the index (kvledger.decisions: the funnel of available, captured and "
        "delivered reuse)",
    )
    p.add_argument(
        "--batch-timeout",
        type=SECONDS,
        default=0.5,
        help="seconds a batch may wait to fill up to --batch-size before it is applied",
    )
    p.add_argument(
        "--until-caught-up",
        action="store_true",
        help="exit 0 once the stored offsets reach the partitions' end offsets",
    )
    p.add_argument(
        "--no-plan-ahead",
        dest="plan_ahead",
        action="store_false",
        help="apply one batch at a time, on one database connection (by default each batch "
        "is planned while the one before it is written, on a second connection)",
    )
    p.add_argument("--metrics-port", type=PORT_OR_OFF, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface for the metrics (0.0.0.0 to reach them from other hosts)",
    )
    p.add_argument(
        "--group-instance-id",
        help="static group membership id: a restart with the same id resumes at once",
    )
    p.add_argument("--no-migrate", action="store_true", help="do not run migrations first")
    _retention_args(p)
    p.add_argument(
        "--retention-every",
        type=SECONDS,
        default=60.0,
        metavar="SECONDS",
        help="seconds between retention passes (each from a thread of its own)",
    )
    p.set_defaults(run=command("consumer_cmds:consume"))

    p = add(
        subparsers,
        "retention",
        extra,
        "show the retained windows and partitions, or run one retention pass (--once)",
    )
    db_arg(p)
    _retention_args(p)
    p.add_argument("--once", action="store_true", help="run one retention pass now")
    p.add_argument("--json", action="store_true", help="the windows and the pass as JSON")
    p.set_defaults(run=command("consumer_cmds:retention_cmd"))

    g = add(subparsers, "groups", extra, "declare or list KV-cache group specs")
    gs = g.add_subparsers(dest="groups_command", metavar="ACTION", required=True)
    p = gs.add_parser("declare", help="declare a group's spec (wins over announcements)")
    db_arg(p)
    p.add_argument("--model", required=True, help="the model the group belongs to")
    p.add_argument(
        "--group",
        type=NON_NEGATIVE,
        required=True,
        dest="group_idx",
        help="the KV-cache group index",
    )
    p.add_argument(
        "--kind", default="full_attention", choices=sorted(SPEC_KINDS), help="the spec kind"
    )
    p.add_argument("--block-size", type=COUNT, required=True, help="tokens per KV block")
    p.add_argument("--hash-block-size", type=COUNT, help="defaults to the block size")
    p.add_argument("--sliding-window", type=COUNT, help="the window, for sliding-window kinds")
    p.set_defaults(run=command("consumer_cmds:groups_declare"))
    p = gs.add_parser("list", help="list group specs")
    db_arg(p)
    p.add_argument("--json", action="store_true", help="one JSON object per group, as a list")
    p.set_defaults(run=command("consumer_cmds:groups_list"))

    d = add(subparsers, "dlq", extra, "inspect or replay rejected events")
    ds = d.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    p = ds.add_parser("list", help="rejections by reason, and the latest rows")
    db_arg(p)
    p.add_argument("--reason", help="only rejections with this reason code")
    p.add_argument(
        "--limit", type=NON_NEGATIVE, default=20, help="rows to show (0: the summary only)"
    )
    p.add_argument("--json", action="store_true", help='{"summary": [...], "rows": [...]} as JSON')
    p.set_defaults(run=command("consumer_cmds:dlq_list"))
    p = ds.add_parser("replay", help="re-apply pending rejected events (idempotent)")
    db_arg(p)
    p.add_argument("--reason", help="only this reason (needed for duplicate and stale_epoch)")
    add_registry_args(p)
    p.set_defaults(run=command("consumer_cmds:dlq_replay"))

    p = add(
        subparsers,
        "verify",
        extra,
        "rebuild the index from the topic into a scratch database and diff it",
    )
    log_args(p, "the live index's consumer group")
    p.add_argument("--scratch-url", help="an empty database to rebuild into (else created)")
    p.add_argument("--show", type=NON_NEGATIVE, default=5, help="example rows per difference")
    p.add_argument(
        "--json",
        action="store_true",
        help='{"ok", "rebuilt_messages", "targets", "rows", "differences"} as JSON',
    )
    p.set_defaults(run=command("consumer_cmds:verify_cmd"))

    p = add(subparsers, "rebuild", extra, "replace the live index with one rebuilt from the topic")
    log_args(p, "the live index's consumer group")
    p.add_argument("--yes", action="store_true", help="confirm: the live index is replaced")
    p.add_argument(
        "--accept-partial",
        action="store_true",
        help="rebuild even when retention has deleted the start of the topic (the rebuilt "
        "index then lacks what only those messages said)",
    )
    p.set_defaults(run=command("consumer_cmds:rebuild_cmd"))
