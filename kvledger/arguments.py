"""Every command's arguments, and nothing else (the parser machinery: kvledger.parsers).
Only light modules are imported here: building the parser must not load a server
dependency."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvledger.consumer.config import DEFAULT_DLQ_TOPIC, DEFAULT_GROUP
from kvledger.consumer.retention_policy import duration_arg
from kvledger.parsers import add, command
from kvledger.schemas.events import SPEC_KINDS
from kvledger.settings import ENV_KAFKA, ENV_KAFKA_CONFIG, ENV_REGISTRY, ENV_REGISTRY_CONFIG

if TYPE_CHECKING:
    from kvledger.parsers import Subparsers

# The defaults of modules that import Kafka's client or more (tests/unit/test_cli_help.py
# holds them equal to kvledger.producer.config.DEFAULT_TOPIC, schemas.topics'
# DEFAULT_PARTITIONS, fleet.DEFAULT_MODEL and the relay's ENGINES).
DEFAULT_TOPIC = "kv-events"
DEFAULT_PARTITIONS = 12
DEFAULT_MODEL = "sim-llama-8b"
ENGINES = ("vllm", "sglang", "trtllm")
ENV_LOOKUP_TOKEN = "KVLEDGER_LOOKUP_TOKEN"
ENV_ADMIN = "KVLEDGER_ADMIN_DATABASE_URL"
ENV_READER_PASSWORD = "KVLEDGER_READER_PASSWORD"


def add_kafka_args(p: argparse.ArgumentParser) -> None:
    """--kafka-config FILE and --kafka-set KEY=VALUE: the cluster's client settings
    (security.protocol, sasl.*, ssl.*, …) for every Kafka client the command opens."""
    p.add_argument(
        "--kafka-config", metavar="FILE",
        help=f"librdkafka settings as a properties file (else ${ENV_KAFKA_CONFIG}), for every "
        "Kafka client the command opens",
    )  # fmt: skip
    p.add_argument(
        "--kafka-set", action="append", default=[], metavar="KEY=VALUE",
        help="one more Kafka client setting (repeat; wins over the file)",
    )  # fmt: skip


def add_registry_args(p: argparse.ArgumentParser) -> None:
    """--schema-registry URL (with its client settings and the subject strategy): Confluent
    Schema Registry framing, for every command that reads or writes the topic."""
    p.add_argument(
        "--schema-registry", metavar="URL",
        help=f"Confluent Schema Registry (else ${ENV_REGISTRY}): readers resolve writer schemas "
        "by id and never register; publishers register under the topic's subject",
    )  # fmt: skip
    p.add_argument(
        "--schema-registry-config", metavar="FILE",
        help=f"registry client settings as properties, e.g. basic.auth.user.info, ssl.ca.location "
        f"(else ${ENV_REGISTRY_CONFIG})",
    )  # fmt: skip
    p.add_argument(
        "--subject-strategy", choices=("topic", "record", "topic_record"),
        help="how publishers name the subject: <topic>-value (topic, the default; "
        "$KVLEDGER_SUBJECT_STRATEGY), kvledger.Envelope (record), <topic>-kvledger.Envelope",
    )  # fmt: skip


def _db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")


def _bootstrap_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--bootstrap", help=f"{prefix}Kafka bootstrap servers (else ${ENV_KAFKA})")


def _log_args(p: argparse.ArgumentParser, group_help: str) -> None:
    """The index's database and the log it is built from: broker, client and registry
    settings, topic, consumer group (consume, verify and rebuild take the same)."""
    _db_arg(p)
    _bootstrap_arg(p)
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the Kafka topic of events")
    p.add_argument("--consumer-group", dest="group", default=DEFAULT_GROUP, help=group_help)


def _retention_args(p: argparse.ArgumentParser) -> None:
    """How long history, audit and blocks no one holds are kept (consume and retention)."""
    p.add_argument(
        "--history-retention", type=duration_arg, default="7d", metavar="D",
        help="keep residency history intervals this long after they closed",
    )  # fmt: skip
    p.add_argument(
        "--audit-retention", type=duration_arg, default="7d", metavar="D",
        help="keep the audit log (events) and rejected events this long",
    )  # fmt: skip
    p.add_argument(
        "--block-retention", type=duration_arg, default="1d", metavar="D",
        help="delete a block row this long after it was last stored, once no residency "
        "holds it and no retained history names it",
    )  # fmt: skip


def add_simulate(subparsers: Subparsers) -> None:
    p = add(subparsers, "simulate", "", "publish a simulated fleet's KV events to Kafka")
    p.add_argument("--instances", type=int, default=4, help="simulated engines")
    p.add_argument("--requests", type=int, default=100, help="requests per instance")
    p.add_argument("--seed", type=int, default=0, help="the simulation's random seed")
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the Kafka topic to publish to")
    p.add_argument(
        "--partitions", type=int, default=DEFAULT_PARTITIONS,
        help="partitions when it creates the topic",
    )  # fmt: skip
    _bootstrap_arg(p)
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument("--model", default=DEFAULT_MODEL, help="the simulated model's name")
    p.add_argument("--rate", type=float, help="pace publishing to this many messages per second")
    p.add_argument(
        "--misconfigured-source",
        action="store_true",
        help="add a source whose block_size disagrees with its announced group spec",
    )
    p.set_defaults(run=command("simulate_cmd:run"))


def add_consumer(subparsers: Subparsers) -> None:
    extra = "consumer"
    p = add(subparsers, "migrate", extra, "create or upgrade the index schema (alembic)")
    _db_arg(p)
    p.add_argument("--revision", default="head", help="the Alembic revision to reach")
    p.add_argument(
        "--partition-interval", type=duration_arg, metavar="D",
        help="the time span of each history and audit partition (90s, 10m, 1d; a new index "
        "starts at 1d); applies from now where the partitions made so far are empty, else "
        "from the end of the newest one in use",
    )  # fmt: skip
    p.set_defaults(run=command("consumer_cmds:migrate_cmd"))

    p = add(subparsers, "consume", extra, "materialize the topic into the index")
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
    _retention_args(p)
    p.add_argument(
        "--retention-every", type=float, default=60.0, metavar="SECONDS",
        help="seconds between retention passes (each from a thread of its own)",
    )  # fmt: skip
    p.set_defaults(run=command("consumer_cmds:consume"))

    p = add(
        subparsers, "retention", extra,
        "show the retained windows and partitions, or run one retention pass (--once)",
    )  # fmt: skip
    _db_arg(p)
    _retention_args(p)
    p.add_argument("--once", action="store_true", help="run one retention pass now")
    p.add_argument("--json", action="store_true", help="the windows and the pass as JSON")
    p.set_defaults(run=command("consumer_cmds:retention_cmd"))

    g = add(subparsers, "groups", extra, "declare or list KV-cache group specs")
    gs = g.add_subparsers(dest="groups_command", metavar="ACTION", required=True)
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
    p.set_defaults(run=command("consumer_cmds:groups_declare"))
    p = gs.add_parser("list", help="list group specs")
    _db_arg(p)
    p.add_argument("--json", action="store_true", help="one JSON object per group, as a list")
    p.set_defaults(run=command("consumer_cmds:groups_list"))

    d = add(subparsers, "dlq", extra, "inspect or replay rejected events")
    ds = d.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    p = ds.add_parser("list", help="rejections by reason, and the latest rows")
    _db_arg(p)
    p.add_argument("--reason", help="only rejections with this reason code")
    p.add_argument("--limit", type=int, default=20, help="rows to show (0: the summary only)")
    p.add_argument("--json", action="store_true", help='{"summary": [...], "rows": [...]} as JSON')
    p.set_defaults(run=command("consumer_cmds:dlq_list"))
    p = ds.add_parser("replay", help="re-apply pending rejected events (idempotent)")
    _db_arg(p)
    p.add_argument("--reason", help="only this reason (needed for duplicate and stale_epoch)")
    add_registry_args(p)
    p.set_defaults(run=command("consumer_cmds:dlq_replay"))

    p = add(
        subparsers, "verify", extra,
        "rebuild the index from the topic into a scratch database and diff it",
    )  # fmt: skip
    _log_args(p, "the live index's consumer group")
    p.add_argument("--scratch-url", help="an empty database to rebuild into (else created)")
    p.add_argument("--show", type=int, default=5, help="example rows per difference")
    p.add_argument(
        "--json", action="store_true",
        help='{"ok", "rebuilt_messages", "targets", "rows", "differences"} as JSON',
    )  # fmt: skip
    p.set_defaults(run=command("consumer_cmds:verify_cmd"))

    p = add(subparsers, "rebuild", extra, "replace the live index with one rebuilt from the topic")
    _log_args(p, "the live index's consumer group")
    p.add_argument("--yes", action="store_true", help="confirm: the live index is replaced")
    p.add_argument(
        "--accept-partial", action="store_true",
        help="rebuild even when retention has deleted the start of the topic (the rebuilt "
        "index then lacks what only those messages said)",
    )  # fmt: skip
    p.set_defaults(run=command("consumer_cmds:rebuild_cmd"))


def add_demo(subparsers: Subparsers) -> None:
    p = add(subparsers, "demo", "all", "run the whole pipeline on a simulated fleet")
    _bootstrap_arg(p)
    p.add_argument("--database-url", help="server to use (else $KVLEDGER_DATABASE_URL)")
    p.add_argument("--instances", type=int, default=4, help="simulated engines (at least 2)")
    p.add_argument("--requests", type=int, default=150, help="requests per instance")
    p.add_argument("--seed", type=int, default=7, help="the simulation's random seed")
    p.add_argument("--keep", action="store_true", help="leave the services up afterwards")
    p.set_defaults(run=command("demo:run"))


def add_lookup(subparsers: Subparsers) -> None:
    p = add(subparsers, "serve", "lookup", "serve prefix lookups over HTTP")
    p.add_argument(
        "--database-url",
        help="SQLAlchemy URL of a read-only role (else $KVLEDGER_LOOKUP_DATABASE_URL, else "
        "$KVLEDGER_DATABASE_URL; either may be given as a file with the _FILE suffix)",
    )
    p.add_argument(
        "--allow-writer", action="store_true",
        help="start even when the database role can write to the index (development only)",
    )  # fmt: skip
    p.add_argument(
        "--memory",
        action="store_true",
        help="answer from an in-memory router index: bootstrapped from the database, then "
        "following the topic (as-of lookups and block rows stay with the SQL mode)",
    )
    p.add_argument(
        "--dynamo-api", action="store_true",
        help="also serve NVIDIA Dynamo's KV-indexer API (/query, /query_by_hash, /dump, "
        "/workers, /register, /unregister) for Dynamo's routers, from an in-memory router "
        "index (the --memory one; without --memory, one of its own beside SQL)",
    )  # fmt: skip
    _bootstrap_arg(p, "with --memory or --dynamo-api: ")
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument(
        "--topic", default=DEFAULT_TOPIC, help="with --memory or --dynamo-api: the events topic"
    )
    p.add_argument(
        "--consumer-group",
        default=DEFAULT_GROUP,
        help="with --memory or --dynamo-api: the consumer group whose stored offsets the "
        "snapshot is at",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument(
        "--statement-timeout", type=float, default=5.0,
        help="seconds a lookup may run in the database before it is answered 503",
    )  # fmt: skip
    p.add_argument(
        "--pool-timeout", type=float, default=5.0,
        help="seconds a request may wait for a free database connection before a 503",
    )  # fmt: skip
    p.add_argument(
        "--token-file",
        help="require `Authorization: Bearer <token>` on every route but /healthz, the token "
        f"read from this file (or from ${ENV_LOOKUP_TOKEN})",
    )
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--pool-size", type=int, default=8, help="database connections at most")
    p.add_argument(
        "--silent-after",
        type=float,
        help="seconds after which a silent source leaves routing answers (else the "
        "database's kvledger.silent_after, 30 s by default)",
    )
    p.set_defaults(run=command("lookup_cmds:serve"))

    p = add(subparsers, "lookup", "consumer", "which instances hold a prompt's prefix")
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")
    p.add_argument("--model", required=True, help="the model to look up")
    p.add_argument("--group", type=int, default=0, help="the KV-cache group index")
    p.add_argument(
        "--token-ids",
        required=True,
        help="comma-separated token ids, or @FILE with whitespace/comma-separated ids",
    )
    p.add_argument("--lora-name", help="only blocks of this LoRA adapter")
    p.add_argument(
        "--include-silent", action="store_true", help="also holders whose source is not live"
    )
    p.add_argument(
        "--silent-after",
        type=float,
        help="seconds after which a silent source is left out (else the database's window)",
    )
    p.add_argument(
        "--json", action="store_true",
        help='{"holders": [...], "ranked": [...]} as JSON (the HTTP API\'s shapes)',
    )  # fmt: skip
    p.set_defaults(run=command("lookup_cmds:lookup"))


def add_sources(subparsers: Subparsers) -> None:
    p = add(
        subparsers, "sources", "consumer",
        "every source: live, silent, closed or restarted; epoch, last seen, gaps, blocks",
    )  # fmt: skip
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")
    p.add_argument(
        "--silent-after",
        type=float,
        help="seconds without a message after which a source is silent (else the "
        "database's kvledger.silent_after, 30 s by default)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per source, as a list")
    p.set_defaults(run=command("sources_cmd:run"))


def add_relay(subparsers: Subparsers) -> None:
    p = add(
        subparsers, "relay", "relay",
        "relay a stock vLLM or SGLang engine's ZMQ KV events into Kafka",
        description=(
            "Subscribe to a vLLM engine's KV-event publisher (started with --kv-events-config "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
            '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'), or an SGLang engine\'s '
            "(--engine sglang; SGLang's --kv-events-config takes the same JSON), and publish "
            "its events to Kafka, recovering missed batches from the engine's replay socket. "
            "One relay per engine; data-parallel ranks listen on consecutive ports."
        ),
    )  # fmt: skip
    p.add_argument(
        "--engine", choices=ENGINES, default="vllm",
        help="whose events: vLLM's or SGLang's ZMQ stream (the same framing and replay), or "
        "TensorRT-LLM's HTTP endpoint (trtllm-serve's POST /kv_cache_events, polled; no "
        "replay): README's Engines table says how each is read",
    )  # fmt: skip
    p.add_argument(
        "--endpoint", required=True,
        help="the engine's PUB endpoint, tcp://HOST:PORT (trtllm: http://HOST:PORT)",
    )  # fmt: skip
    p.add_argument(
        "--poll-interval", type=float, default=0.2,
        help="trtllm: seconds between polls of the engine's events",
    )  # fmt: skip
    p.add_argument(
        "--replay-endpoint",
        help="the engine's replay (ROUTER) endpoint; without it gaps cannot be recovered",
    )
    p.add_argument("--source", required=True, help="the engine's source id in the index")
    p.add_argument("--model", required=True, help="the model the engine serves")
    p.add_argument(
        "--dp-size", type=int, default=1,
        help="data-parallel ranks: rank r listens on the endpoints' ports + r and is source "
        "<source>-dp<r>",
    )  # fmt: skip
    p.add_argument(
        "--group", action="append", default=[], metavar="IDX:KIND:BLOCK_SIZE[:HASH_BLOCK_SIZE]",
        help="a KV-cache group's spec to announce (repeat per group); groups without one "
        "need an operator's `kvledger groups declare`",
    )  # fmt: skip
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the Kafka topic")
    p.add_argument("--engine-topic", default="", help="the engine's ZMQ topic (vLLM's `topic`)")
    _bootstrap_arg(p)
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument(
        "--partitions", type=int, default=DEFAULT_PARTITIONS,
        help="partitions when the relay creates the topic",
    )  # fmt: skip
    p.add_argument(
        "--surviving-media", default=None,
        help="comma-separated media whose blocks outlive an engine restart (default STORAGE)",
    )  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="interface for /metrics")
    p.add_argument(
        "--heartbeat-interval", type=float, default=5.0,
        help="seconds of engine silence before probing it and sending a heartbeat (0: never)",
    )  # fmt: skip
    p.set_defaults(run=command("relay_cmd:run"))


def add_roles(subparsers: Subparsers) -> None:
    roles = add(
        subparsers, "roles", "consumer", "database roles",
        description="Database roles: the index's owner (the consumer) and a read-only login "
        "for the lookup service.",
    )  # fmt: skip
    sub = roles.add_subparsers(dest="roles_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "create-reader",
        help="create the lookup service's read-only login (or re-password it)",
        description="Create the login role NAME, a member of kvledger_reader, which may read "
        "the index and call its lookup functions and nothing else; then grant the reads as "
        "the owner. A role that exists already is refused unless --reset-password says to "
        "give it the new password (the logins that use the old one then stop working). The "
        "password is read from a file or the environment, never from the command line, and "
        "is sent as a SCRAM verifier.",
    )
    p.add_argument("name", nargs="?", default="kvledger_lookup", help="the login role's name")
    p.add_argument(
        "--password-file",
        help=f"the password, first line of this file (else ${ENV_READER_PASSWORD} or "
        f"${ENV_READER_PASSWORD}_FILE)",
    )
    p.add_argument(
        "--reset-password", action="store_true",
        help="the role exists: give it this password (else an existing role is refused)",
    )  # fmt: skip
    p.add_argument(
        "--admin-database-url",
        help=f"a role that may create roles (else ${ENV_ADMIN}, else the owner's URL)",
    )
    p.add_argument(
        "--database-url", help="the index owner's URL, which grants (else $KVLEDGER_DATABASE_URL)"
    )
    p.set_defaults(run=command("roles_cmd:create_reader_cmd"))


ADDERS = (add_simulate, add_consumer, add_demo, add_lookup, add_sources, add_relay, add_roles)


def add_commands(subparsers: Subparsers) -> None:
    for adder in ADDERS:
        adder(subparsers)
