"""The ``kvledger`` command: configuration is read here, at the edge, and passed inward."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import psycopg
from confluent_kafka import KafkaException

from kvledger import (
    __version__,
    consumer_cmds,
    demo,
    lookup_cmds,
    relay_cmd,
    roles_cmd,
    simulate_cmd,
    sources_cmd,
)
from kvledger.consumer.db import redact
from kvledger.schemas.errors import KvledgerError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvledger", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvledger {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    simulate_cmd.add_parser(subparsers)
    consumer_cmds.add_parsers(subparsers)
    consumer_cmds.add_reliability_parsers(subparsers)
    demo.add_parser(subparsers)
    lookup_cmds.add_parsers(subparsers)
    sources_cmd.add_parser(subparsers)
    relay_cmd.add_parser(subparsers)
    roles_cmd.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("alembic").setLevel(logging.WARNING)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        result: int = args.run(args)
    except (psycopg.OperationalError, KafkaException, KvledgerError) as exc:
        if args.verbose:
            raise
        # The usual failures (a database or broker that does not answer, a refused operation)
        # in one line; -v shows the traceback.
        what = "database" if isinstance(exc, psycopg.OperationalError) else (
            "Kafka" if isinstance(exc, KafkaException) else "error"
        )  # fmt: skip
        first = redact(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        if isinstance(exc, KafkaException) and exc.args and hasattr(exc.args[0], "name"):
            name = exc.args[0].name()
            if name.endswith("_AUTHORIZATION_FAILED") or name.endswith("AUTHENTICATION"):
                first = (
                    f"{name}: the principal of the Kafka settings (--kafka-config) is refused; "
                    "it needs an ACL for this operation (README: Security)"
                )
            elif name in {"_TRANSPORT", "_TIMED_OUT", "_ALL_BROKERS_DOWN"}:
                first += (
                    " (no broker answered: check --bootstrap and the Kafka settings' TLS CA, "
                    "SASL mechanism and credentials)"
                )
        print(f"kvledger {args.command}: {what}: {first}", file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
