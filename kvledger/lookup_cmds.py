"""`kvledger serve` (the HTTP lookup service) and `kvledger lookup` (one prompt, a table)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from kvledger import settings
from kvledger.consumer.db import connect
from kvledger.consumer.lookup import PrefixIndex, rank
from kvledger.process import freeze_startup_objects
from kvledger.tables import print_table

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


ENV_LOOKUP_TOKEN = "KVLEDGER_LOOKUP_TOKEN"


def add_parsers(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve prefix lookups over HTTP")
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
        "--bootstrap", help="with --memory: Kafka servers (else $KVLEDGER_KAFKA_BOOTSTRAP)"
    )
    settings.add_kafka_args(p)
    settings.add_registry_args(p)
    p.add_argument("--topic", default="kv-events", help="with --memory: the events topic")
    p.add_argument(
        "--consumer-group",
        default="kvledger-index",
        help="with --memory: the consumer group whose stored offsets the snapshot is at",
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
    p.set_defaults(run=_serve)

    p = subparsers.add_parser("lookup", help="which instances hold a prompt's prefix")
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
    p.set_defaults(run=_lookup)


def parse_token_ids(text: str) -> list[int]:
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    parts = text.replace(",", " ").split()
    try:
        return [int(p) for p in parts]
    except ValueError as exc:
        raise SystemExit(f"kvledger: token ids must be integers ({exc})") from None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvledger.consumer.lookup.http import create_app

    window = timedelta(seconds=args.silent_after) if args.silent_after else None
    database = settings.lookup_database_url(args.database_url)
    token = _token(args.token_file)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("kvledger serve: --tls-cert and --tls-key go together")
    server = {
        "host": args.host, "port": args.port, "log_level": "info", "access_log": False,
        "ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key,
    }  # fmt: skip
    if not args.memory:
        app = create_app(
            database, args.pool_size, window, token=token,
            statement_timeout_ms=int(args.statement_timeout * 1000),
            pool_timeout_s=args.pool_timeout, allow_writer=args.allow_writer,
        )  # fmt: skip
        freeze_startup_objects()
        uvicorn.run(app, **server)
        return 0
    from kvledger.consumer.router.index import RouterIndex

    router = RouterIndex(
        settings.kafka_bootstrap(args), args.topic, args.consumer_group,
        kafka=dict(settings.kafka_settings(args)),
        codec=settings.codec(args, args.topic, writer=False),
    )  # fmt: skip
    with connect(database) as conn:
        router.bootstrap(conn)
    router.start()
    freeze_startup_objects()
    try:
        app = create_app(silent_after=window, router=router, token=token)
        uvicorn.run(app, **server)
    finally:
        router.stop()
    return 0


def _lookup(args: argparse.Namespace) -> int:
    tokens = parse_token_ids(args.token_ids)
    if not tokens:
        print("kvledger: no token ids given", file=sys.stderr)
        return 2
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        window = timedelta(seconds=args.silent_after) if args.silent_after else None
        holders = PrefixIndex(conn).match_tokens(
            args.model, args.group, tokens, args.lora_name, args.include_silent, window
        )
    if args.json:
        ranked = [asdict(r) for r in rank(holders)] if holders else []
        print(json.dumps({"holders": [asdict(h) for h in holders], "ranked": ranked}))
        return 0
    print(f"prompt of {len(tokens)} tokens, model {args.model}, group {args.group}")
    if not holders:
        print("no instance holds any prefix of this prompt")
        return 0
    print_table(
        ("instance", "medium", "ownership", "blocks", "tokens", "source"),
        [(h.instance, h.medium, h.ownership or "-", h.matched_blocks, h.matched_tokens,
          h.source_state) for h in holders],
    )  # fmt: skip
    best = rank(holders)[0]
    print(f"route to {best.instance} (score {best.score:,.0f})")
    return 0


def _token(path: str | None) -> str | None:
    """The bearer token: from ``path`` (its first line), else the environment, else none."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as exc:
            raise SystemExit(f"kvledger serve: cannot read the token file: {exc}") from None
        if not token:
            raise SystemExit(f"kvledger serve: the token file {path} is empty")
        return token
    return os.environ.get(ENV_LOOKUP_TOKEN) or None
