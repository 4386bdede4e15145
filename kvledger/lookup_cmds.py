"""`kvledger serve` (the HTTP lookup service) and `kvledger lookup` (one prompt, a table);
their arguments: kvledger.arguments."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from dataclasses import asdict
from datetime import timedelta
from typing import TYPE_CHECKING

from kvledger import files, settings
from kvledger.consumer.db import connect
from kvledger.options import ENV_LOOKUP_TOKEN
from kvledger.process import collect_less_often, freeze_startup_objects
from kvledger.schemas.lookup import Holder, Ranked
from kvledger.serving.lookup import PrefixIndex, rank
from kvledger.serving.lookup.api import split_live, tied, unknown_group
from kvledger.tables import print_table

if TYPE_CHECKING:
    from kvledger.serving.router.decisions import DecisionLog
    from kvledger.serving.router.index import RouterIndex
    from kvledger.serving.router.provisional import Provisional


PROMPT_FILE_LIMIT = 64 << 20  # a prompt's token ids from a file (`--token-ids @FILE`)


def parse_token_ids(text: str) -> list[int]:
    if text.startswith("@"):
        try:
            text = files.read_text(text[1:], PROMPT_FILE_LIMIT)
        except (OSError, ValueError) as exc:  # FileTooLargeError, UnicodeDecodeError
            raise SystemExit(f"kvledger: cannot read the token ids of {text}: {exc}") from None
    parts = text.replace(",", " ").split()
    try:
        return [int(p) for p in parts]
    except ValueError as exc:
        raise SystemExit(f"kvledger: token ids must be integers ({exc})") from None


class _ServerLines(logging.Filter):
    """uvicorn logs its ordinary start-up and shutdown lines under ``uvicorn.error``: those
    below a warning are the service's (``kvledger.serve``), not errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            record.name = "kvledger.serve"
        return True


def _check_port(host: str, port: int) -> None:
    """Exit with one line when ``host:port`` cannot be listened on (uvicorn would log a
    bare ``[Errno 98]`` and exit 3, after the index was loaded)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise SystemExit(f"kvledger serve: --host {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc})"
            raise SystemExit(
                f"kvledger serve: port {port} on {host} {why}: stop what listens there "
                "(`ss -ltnp` names it) or pass another --port"
            ) from None


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvledger.serving.lookup.guarded_protocol import HttpLimits
    from kvledger.serving.lookup.hot_protocol import protocol
    from kvledger.serving.lookup.http import ServiceConfig, create_app

    window = timedelta(seconds=args.silent_after) if args.silent_after else None
    database = settings.lookup_database_url(args.database_url)
    token = _token(args.token_file)
    if (warning := exposure_warning(args.host, token)) is not None:
        print(warning, file=sys.stderr)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("kvledger serve: --tls-cert and --tls-key go together")
    _check_port(args.host, args.port)  # before a router's bootstrap: seconds to minutes
    logging.getLogger("uvicorn.error").addFilter(_ServerLines())
    server = {
        "host": args.host,
        "port": args.port,
        "log_level": "info",
        "access_log": False,
        "ssl_certfile": args.tls_cert,
        "ssl_keyfile": args.tls_key,
        # Nothing reads the client's address (no access log; tokens, not addresses, admit),
        # so uvicorn's X-Forwarded-* rewriting would be a layer per request for nothing.
        "proxy_headers": False,
        # uvicorn's lines through kvledger's own handler (and --log-format), not its own.
        "log_config": None,
    }
    # Dynamo's API is answered from a router index (it keeps Dynamo's block hashes): the
    # memory mode's own, or, beside the SQL mode, one of its own.
    router = _router(args, database) if args.memory or args.dynamo_api else None
    decisions = None
    try:
        if args.memory:
            assert router is not None
            provisional, decisions = _decisions(args, router)
            config = ServiceConfig(
                silent_after=window,
                router=router,
                token=token,
                dynamo_api=args.dynamo_api,
                provisional=provisional,
                share=decisions.publish if decisions is not None else None,
                record_answer=decisions.note_answer if decisions is not None else None,
            )
        else:
            config = ServiceConfig(
                database,
                args.pool_size,
                window,
                token=token,
                statement_timeout_ms=int(args.statement_timeout * 1000),
                pool_timeout_s=args.pool_timeout,
                allow_writer=args.allow_writer,
                dynamo_api=args.dynamo_api,
                dynamo_router=router,
            )
        app = create_app(config)
        # Within the HTTP limits, its hot routes answered in uvicorn's HTTP parsing.
        server["http"] = protocol(app, HttpLimits(max_connections=args.max_connections))
        _raise_open_files(args.max_connections)
        freeze_startup_objects()
        collect_less_often()
        uvicorn.run(app, **server)
    finally:
        if decisions is not None:
            decisions.stop()
        if router is not None:
            router.stop()
    return 0


def _decisions(
    args: argparse.Namespace, router: RouterIndex
) -> tuple[Provisional, DecisionLog | None]:
    """Where routers' decisions are held (and, with --decisions-topic, shared)."""
    from kvledger.serving.lookup.metrics import PROVISIONAL
    from kvledger.serving.router.decisions import DecisionLog
    from kvledger.serving.router.provisional import Provisional

    provisional = Provisional(args.provisional_window)
    if args.decisions_topic is None:
        return provisional, None
    log = DecisionLog(
        settings.kafka_bootstrap(args),
        args.decisions_topic,
        provisional,
        kafka=dict(settings.kafka_settings(args)),
    )
    log.start()
    PROVISIONAL.logs.add(log)
    return provisional, log


def _raise_open_files(connections: int) -> None:
    """Room for ``connections`` sockets beside the service's own files: the soft limit on
    open files raised toward the hard one (a server out of descriptors stops accepting)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < want:
            print(
                f"kvledger serve: {target} open files at most (the hard limit): fewer than "
                f"--max-connections {connections} and the service's own",
                file=sys.stderr,
            )


def _router(args: argparse.Namespace, database: str) -> RouterIndex:
    """The router index `serve` answers from: bootstrapped from the database, following
    the topic (with Dynamo's block hashes when --dynamo-api asks)."""
    from kvledger.schemas.replication import warn_under_replicated_later
    from kvledger.serving.router.index import RouterIndex

    topics = [args.topic, args.decisions_topic]
    kafka = settings.kafka_settings(args)
    warn_under_replicated_later(settings.kafka_bootstrap(args), kafka, filter(None, topics))
    router = RouterIndex(
        settings.kafka_bootstrap(args),
        args.topic,
        args.consumer_group,
        kafka=dict(settings.kafka_settings(args)),
        codec=settings.codec(args, args.topic, writer=False),
        dynamo=args.dynamo_api,
        block_retention=args.block_retention,
    )
    with connect(database) as conn:
        router.bootstrap(conn)
    router.start()
    return router


def lookup(args: argparse.Namespace) -> int:
    tokens = parse_token_ids(args.token_ids)
    if not tokens:
        print("kvledger: no token ids given", file=sys.stderr)
        return 2
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        window = timedelta(seconds=args.silent_after) if args.silent_after else None
        index = PrefixIndex(conn)
        holders = index.match_tokens(
            args.model, args.group, tokens, args.lora_name, True, window, args.cache_salt
        )
        unknown = not holders and not index.knows_group(args.model, args.group)
    left_out: list[Holder] = []
    if not args.include_silent:
        holders, left_out = split_live(holders)
    if args.json:
        ranked = [asdict(r) for r in rank(holders)] if holders else []
        answer: dict[str, object] = {
            "holders": [asdict(h) for h in holders],
            "ranked": ranked,
            "left_out": [asdict(h) for h in left_out],
        }
        if unknown:
            answer["unknown_group"] = unknown_group(args.model, args.group)
        print(json.dumps(answer))
        return 1 if unknown else 0
    if unknown:
        print(f"kvledger lookup: {unknown_group(args.model, args.group)}", file=sys.stderr)
        return 1
    print(f"prompt of {len(tokens)} tokens, model {args.model}, group {args.group}")
    if holders:
        print_table(
            ("instance", "medium", "ownership", "blocks", "tokens", "source"),
            [
                (
                    h.instance,
                    h.medium,
                    h.ownership or "-",
                    h.matched_blocks,
                    h.matched_tokens,
                    h.source_state,
                )
                for h in holders
            ],
        )
    else:
        print("no live instance holds any prefix of this prompt")
    if left_out:
        states = Counter(h.source_state for h in left_out)
        why = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        instances = len({h.instance for h in left_out})
        print(
            f"left out: {len(left_out)} holder(s) on {instances} instance(s) whose source is "
            f"not live ({why}); --include-silent shows them, --silent-after widens the window"
        )
    if holders:
        print(_routing(rank(holders)))
    return 0


def _routing(ranked: list[Ranked]) -> str:
    """Where to route, and whether the best score is shared."""
    best, sharing = ranked[0], tied(ranked)
    if len(sharing) == 1:
        return f"route to {best.instance} (score {best.score:,.0f})"
    return f"a {len(sharing)}-way tie at score {best.score:,.0f}: {', '.join(sharing)}"


def exposure_warning(host: str, token: str | None) -> str | None:
    """What to say when the service would answer anyone who can reach a public address."""
    if token is not None or _loopback(host):
        return None
    return (
        f"kvledger serve: warning: listening on {host} without a token: anyone who reaches "
        f"this address can query the index (set --token-file or ${ENV_LOOKUP_TOKEN})"
    )


def _loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine alone (a loopback address or name)."""
    import ipaddress

    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def _token(path: str | None) -> str | None:
    """The bearer token: from ``path`` (its first line), else the environment, else none."""
    if path:
        try:
            token = files.first_line(path)
        except (OSError, ValueError) as exc:  # FileTooLargeError, UnicodeDecodeError
            raise SystemExit(f"kvledger serve: cannot read the token file: {exc}") from None
        if not token:
            raise SystemExit(f"kvledger serve: the token file {path} is empty")
        return token
    return os.environ.get(ENV_LOOKUP_TOKEN) or None
