"""Every command's arguments, and nothing else (the parser machinery: kvledger.parsers).
Only light modules are imported here: building the parser must not load a server
dependency."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.arguments_consumer import add_consumer
from kvledger.arguments_relay import add_relay
from kvledger.arguments_replay import add_replay
from kvledger.consumer.config import DEFAULT_GROUP
from kvledger.consumer.retention_policy import duration_arg, seconds_arg
from kvledger.options import (
    DEFAULT_MODEL,
    DEFAULT_PARTITIONS,
    DEFAULT_TOPIC,
    ENV_ADMIN,
    ENV_LOOKUP_TOKEN,
    ENV_READER_PASSWORD,
    add_kafka_args,
    add_registry_args,
    bootstrap_arg,
    metrics_args,
    silent_after_arg,
)
from kvledger.parsers import (
    COUNT,
    NON_NEGATIVE,
    PORT,
    SECONDS,
    add,
    command,
)

if TYPE_CHECKING:
    from kvledger.parsers import Subparsers


def add_simulate(subparsers: Subparsers) -> None:
    p = add(subparsers, "simulate", "", "publish a simulated fleet's KV events to Kafka")
    p.add_argument("--instances", type=COUNT, default=4, help="simulated engines")
    p.add_argument("--requests", type=COUNT, default=100, help="requests per instance")
    p.add_argument("--seed", type=int, default=0, help="the simulation's random seed")
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the Kafka topic to publish to")
    p.add_argument(
        "--partitions",
        type=COUNT,
        default=DEFAULT_PARTITIONS,
        help="partitions when it creates the topic",
    )
    bootstrap_arg(p)
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument("--model", default=DEFAULT_MODEL, help="the simulated model's name")
    p.add_argument("--rate", type=SECONDS, help="pace publishing to this many messages per second")
    p.add_argument(
        "--gpu-blocks",
        type=NON_NEGATIVE,
        default=256,
        metavar="N",
        help="each engine's GPU block pool, in blocks, published as vLLM's pool does (least "
        "recently used evicted); 0: engines that publish their CPU and storage tiers only",
    )
    p.add_argument(
        "--misconfigured-source",
        action="store_true",
        help="add a source whose block_size disagrees with its announced group spec",
    )
    p.add_argument(
        "--prompt-out",
        metavar="FILE",
        help="write the token ids of the last prompt the fleet served to FILE (for "
        "`kvledger lookup --token-ids @FILE`)",
    )
    p.set_defaults(run=command("simulate_cmd:run"))


def add_demo(subparsers: Subparsers) -> None:
    p = add(subparsers, "demo", "all", "run the whole pipeline on a simulated fleet")
    bootstrap_arg(p)
    p.add_argument("--database-url", help="server to use (else $KVLEDGER_DATABASE_URL)")
    p.add_argument("--instances", type=COUNT, default=4, help="simulated engines (at least 2)")
    p.add_argument("--requests", type=COUNT, default=150, help="requests per instance")
    p.add_argument("--seed", type=int, default=7, help="the simulation's random seed")
    p.add_argument("--keep", action="store_true", help="leave the services up afterwards")
    p.add_argument(
        "--name",
        default="demo",
        help="its database <database>_NAME, topic kv-events-NAME and group kvledger-NAME "
        "(a-z, 0-9, _; default demo)",
    )
    p.set_defaults(run=command("demo:run"))


def add_lookup(subparsers: Subparsers) -> None:
    p = add(subparsers, "serve", "lookup", "serve prefix lookups over HTTP")
    p.add_argument(
        "--database-url",
        help="SQLAlchemy URL of a read-only role (else $KVLEDGER_LOOKUP_DATABASE_URL, else "
        "$KVLEDGER_DATABASE_URL; either may be given as a file with the _FILE suffix)",
    )
    p.add_argument(
        "--allow-writer",
        action="store_true",
        help="start even when the database role can write to the index (development only)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="answer from an in-memory router index: bootstrapped from the database, then "
        "following the topic (as-of lookups and block rows stay with the SQL mode)",
    )
    p.add_argument(
        "--dynamo-api",
        action="store_true",
        help="also serve NVIDIA Dynamo's KV-indexer API (/query, /dump, /workers, ...) from "
        "an in-memory router index (--memory's, else one of its own beside SQL)",
    )
    bootstrap_arg(p, "with --memory or --dynamo-api: ")
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
        "--statement-timeout",
        type=SECONDS,
        default=5.0,
        help="seconds a lookup may run in the database before it is answered 503",
    )
    p.add_argument(
        "--pool-timeout",
        type=SECONDS,
        default=5.0,
        help="seconds a request may wait for a free database connection before a 503",
    )
    p.add_argument(
        "--token-file",
        help="require `Authorization: Bearer <token>` on every route but /healthz and the "
        "dashboard's page (/ui: its data, /v1/dashboard, needs the token), the token "
        f"read from this file (or from ${ENV_LOOKUP_TOKEN})",
    )
    p.add_argument("--port", type=PORT, default=8080, help="port to listen on")
    p.add_argument(
        "--max-connections",
        type=COUNT,
        default=4096,
        help="open client connections at most; past it, the one waiting longest for a request "
        "head is closed (default 4096)",
    )
    p.add_argument("--pool-size", type=COUNT, default=8, help="database connections at most")
    silent_after_arg(p, "after which a silent source leaves routing answers")
    p.add_argument(
        "--block-retention",
        type=duration_arg,
        default="1d",
        metavar="D",
        help="with --memory or --dynamo-api: forget a block this long after it was last "
        "stored or held, once no one holds it and no block names it as its parent",
    )
    p.add_argument(
        "--provisional-window",
        type=seconds_arg,
        default=5.0,
        metavar="S",
        help="with --memory: how long (5, 2s) an engine a router reported sending a prompt "
        "to (POST /v1/decisions) is answered as its provisional holder (default 5 s)",
    )
    p.add_argument(
        "--decisions-topic",
        metavar="TOPIC",
        help="with --memory: share routers' decisions with every replica of the service "
        "through this topic (created if missing); without it, each replica holds its own",
    )
    p.set_defaults(run=command("lookup_cmds:serve"))

    p = add(subparsers, "lookup", "consumer", "which instances hold a prompt's prefix")
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")
    p.add_argument("--model", required=True, help="the model to look up")
    p.add_argument("--group", type=NON_NEGATIVE, default=0, help="the KV-cache group index")
    p.add_argument(
        "--token-ids",
        required=True,
        help="comma-separated token ids, or @FILE with whitespace/comma-separated ids",
    )
    p.add_argument("--lora-name", help="only blocks of this LoRA adapter")
    p.add_argument("--cache-salt", help="the cache salt the engine hashed the prompt with")
    p.add_argument(
        "--include-silent", action="store_true", help="also holders whose source is not live"
    )
    silent_after_arg(p, "after which a silent source is left out")
    p.add_argument(
        "--json",
        action="store_true",
        help='{"holders": [...], "ranked": [...]} as JSON (the HTTP API\'s shapes)',
    )
    p.set_defaults(run=command("lookup_cmds:lookup"))


def add_sources(subparsers: Subparsers) -> None:
    p = add(
        subparsers,
        "sources",
        "consumer",
        "every source: live, silent, closed or restarted; epoch, last seen, gaps, blocks",
    )
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")
    silent_after_arg(p, "without a message after which a source is silent")
    p.add_argument("--json", action="store_true", help="one JSON object per source, as a list")
    p.set_defaults(run=command("sources_cmd:run"))


def add_republish(subparsers: Subparsers) -> None:
    p = add(
        subparsers,
        "republish",
        "republish",
        "republish each engine's events, as the index holds them, on vLLM's ZMQ sockets",
        description=(
            "Follow the index (bootstrapped from the database, then the topic). Publish each "
            "source's events in vLLM's own ZMQ protocol, so a router made for vLLM's stream "
            "(vllm-router's kv_aware, Dynamo's indexer, llm-d) needs only a new address. "
            "Each source gets a PUB socket and a replay ROUTER (--source); one PUB serves all "
            "with topics kv@<source>@<model> (--mux-port). What the index corrects is said "
            "too. An engine restart ends the tiers that died with it. A recorded loss clears "
            "what the index cleared. A source silent past --silent-after is cleared, and "
            "restated when it speaks again. A rejected event is not republished. A new "
            "subscriber, and a replay older than what is retained, get the source's holdings "
            "first. docs/routers.md (kvledger republish) has the details."
        ),
    )
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PORT[:REPLAY_PORT]",
        help="republish source NAME on a PUB socket at PORT (and its replay at REPLAY_PORT); "
        "repeat per source",
    )
    p.add_argument(
        "--mux-port",
        type=PORT,
        help="also one PUB socket for every source, topics kv@<source>@<model>",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface the sockets bind (* for all, as vLLM binds tcp://*:PORT)",
    )
    p.add_argument(
        "--zmq-topic", default="", help="the topic frame of each source's PUB (vLLM's `topic`)"
    )
    p.add_argument(
        "--buffer-steps",
        type=COUNT,
        default=10_000,
        help="batches each source's replay retains (vLLM's buffer_steps); older requests get "
        "the source's holdings",
    )
    silent_after_arg(p, "after which a silent source is republished as holding nothing")
    p.add_argument(
        "--database-url",
        help="the index to bootstrap from (else $KVLEDGER_LOOKUP_DATABASE_URL, else "
        "$KVLEDGER_DATABASE_URL)",
    )
    bootstrap_arg(p)
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the events topic")
    p.add_argument(
        "--consumer-group",
        default=DEFAULT_GROUP,
        help="the consumer group whose stored offsets the bootstrap snapshot is at",
    )
    p.add_argument(
        "--block-retention",
        type=duration_arg,
        default="1d",
        metavar="D",
        help="forget a block this long after it was last stored or held, once no one holds "
        "it and no block names it as its parent",
    )
    metrics_args(p)
    p.set_defaults(run=command("republish_cmd:run"))


def add_roles(subparsers: Subparsers) -> None:
    roles = add(
        subparsers,
        "roles",
        "consumer",
        "database roles",
        description="Database roles: the index's owner (the consumer) and a read-only login "
        "for the lookup service.",
    )
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
        "--reset-password",
        action="store_true",
        help="the role exists: give it this password (else an existing role is refused)",
    )
    p.add_argument(
        "--admin-database-url",
        help=f"a role that may create roles (else ${ENV_ADMIN}, else the owner's URL)",
    )
    p.add_argument(
        "--database-url", help="the index owner's URL, which grants (else $KVLEDGER_DATABASE_URL)"
    )
    p.set_defaults(run=command("roles_cmd:create_reader_cmd"))


def add_status(subparsers: Subparsers) -> None:
    p = add(
        subparsers,
        "status",
        "consumer",
        "the index at a glance: schema, sources by state, blocks by tier, rejections pending, "
        "and (given a broker) how far the consumer group is behind",
    )
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")
    bootstrap_arg(p, "optional: the consumer group's lag from this broker; ")
    add_kafka_args(p)
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the events topic")
    p.add_argument("--consumer-group", default=DEFAULT_GROUP, help="the index's consumer group")
    silent_after_arg(p, "without a message after which a source is silent")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(
        "--stalled-after",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="a reader behind the log with no progress for this long is stalled (needs an "
        "operator): the index consumer, and the decision recorder",
    )
    p.set_defaults(run=command("status_cmd:run"))


def add_completion(subparsers: Subparsers) -> None:
    p = add(
        subparsers,
        "completion",
        "",
        'a shell completion script: eval "$(kvledger completion bash)" in ~/.bashrc',
    )
    p.add_argument("shell", choices=("bash", "zsh"), help="the shell")
    p.set_defaults(run=command("completion:run"))


ADDERS = (
    add_simulate,
    add_consumer,
    add_demo,
    add_lookup,
    add_sources,
    add_status,
    add_relay,
    add_replay,
    add_republish,
    add_roles,
    add_completion,
)


def add_commands(subparsers: Subparsers) -> None:
    for adder in ADDERS:
        adder(subparsers)
