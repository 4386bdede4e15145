"""The ``kvledger`` command: configuration is read here, at the edge, and passed inward."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from kvledger import __version__, arguments, envopts, parsers
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.redact import redact

# A module missing at run time → the extra that brings it.
_EXTRA_OF = {
    "psycopg": "consumer",
    "psycopg_pool": "consumer",
    "sqlalchemy": "consumer",
    "alembic": "consumer",
    "prometheus_client": "consumer",
    "starlette": "lookup",
    "uvicorn": "lookup",
    "zmq": "relay",
    "msgspec": "relay",
    "authlib": "registry",
    "httpx": "registry",
    "attrs": "registry",
    "cachetools": "registry",
}


def _needs(command: str, extra: str, module: str | None) -> int:
    print(
        f"kvledger {command}: this install lacks {module or 'a dependency'}: "
        f"pip install 'kvledger[{extra}]'",
        file=sys.stderr,
    )
    return 1


def _usual_errors() -> tuple[type[BaseException], ...]:
    """The failures printed as one line: Kafka's, kvledger's, and PostgreSQL's when the
    consumer extra is installed."""
    from confluent_kafka import KafkaException

    errors: list[type[BaseException]] = [KafkaException, KvledgerError]
    if "psycopg" in sys.modules:  # the command used the database: the consumer extra is in
        from kvledger.consumer.db import SCHEMA_MISSING_ERRORS

        errors += [sys.modules["psycopg"].OperationalError, *SCHEMA_MISSING_ERRORS]
    return tuple(errors)


DESCRIPTION = (
    "kvledger: a durable, auditable index of which serving instance holds which KV-cache "
    "blocks, built from engines' events in Kafka into PostgreSQL, with prefix lookups for "
    "routers."
)
EPILOG = (
    "Every option can also be set by an environment variable, named in each command's "
    "--help (KVLEDGER_<COMMAND>_<OPTION>); a flag wins over the variable. `kvledger COMMAND "
    "--help` describes a command."
)


def _describe(parser: argparse.ArgumentParser) -> None:
    """A subcommand with no description of its own shows its one-line help as one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if sub.description is None and helps.get(name):
                    text = str(helps[name])
                    sub.description = text[0].upper() + text[1:] + "."
                _describe(sub)


class _Version(argparse.Action):
    """--version: the version, then which compiled parts are in use (looked up only when
    asked, so that building the parser imports none of them)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        from kvledger.schemas.codec import compiled_parts

        parts = ", ".join(
            f"{name} {'compiled' if on else 'missing' if name == 'router index' else 'pure Python'}"
            for name, on in compiled_parts().items()
        )
        print(f"kvledger {__version__} ({parts})")
        parser.exit()


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser, each option bound to its variable in ``environ`` (default:
    this process's environment)."""
    parser = parsers.Parser(prog="kvledger", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--version",
        action=_Version,
        nargs=0,
        help="the version, and which compiled parts this install uses (else pure Python)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        "--debug",
        dest="verbose",
        action="store_true",
        help="debug logging, and the traceback of an error (else one line)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text, or as one JSON object each (for log collectors)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    arguments.add_commands(subparsers)
    for path, sub in envopts.commands(parser):
        if path:  # after a command too: `kvledger sources --debug`
            sub.add_argument(
                "-v",
                "--verbose",
                "--debug",
                dest="verbose",
                action="store_true",
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
            sub.add_argument(
                "--log-format",
                choices=("text", "json"),
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    envopts.bind(parser, environ)
    _describe(parser)
    return parser


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message (passwords
    redacted), and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        if record.exc_info:
            out["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(out)


def main(argv: Sequence[str] | None = None) -> int:
    from kvledger import envopts
    from kvledger.config_file import ConfigFileError, check, load

    try:
        found, named = load()  # before the parser binds the environment to its options
        parser = build_parser()
        if found is not None:
            check(found, named, envopts.known(parser))
    except ConfigFileError as exc:
        print(f"kvledger: the config file: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _configure_logging(args)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        result: int = args.run(args)
    except KeyboardInterrupt:
        return _interrupted(args)
    except SystemError as exc:  # Ctrl-C inside a C library's callback arrives wrapped
        if args.verbose or not isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
            raise
        return _interrupted(args)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if args.verbose or root not in _EXTRA_OF:
            raise
        return _needs(args.command, _EXTRA_OF[root], root)
    except _usual_errors() as exc:
        if args.verbose:
            raise
        # The usual failures (a database or broker that does not answer, a refused operation)
        # in one line; -v shows the traceback.
        what, first = _one_line(exc)
        print(f"kvledger {args.command}: {what}: {first}", file=sys.stderr)
        return 1
    return result


def _configure_logging(args: argparse.Namespace) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    if not args.verbose:
        # Libraries that log each step at INFO: a migration's, or each HTTP request (the
        # TensorRT-LLM relay polls every 0.2 s: 18,000 lines an hour).
        for name in ("alembic", "httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _one_line(exc: BaseException) -> tuple[str, str]:
    """A usual failure as (what failed, the one line that says so and what to check)."""
    from confluent_kafka import KafkaException

    what = (
        "Kafka"
        if isinstance(exc, KafkaException)
        else ("error" if isinstance(exc, KvledgerError) else "database")
    )
    first = redact(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
    if what == "database" and not isinstance(exc, sys.modules["psycopg"].OperationalError):
        from kvledger.consumer.db import SCHEMA_MISSING

        return what, SCHEMA_MISSING
    if what == "database" and "Connection refused" in str(exc):
        first += (
            ": is PostgreSQL running there? `scripts/services up` starts a local one; else "
            "check --database-url (or $KVLEDGER_DATABASE_URL)"
        )
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if error is None:
        return what, first
    if hasattr(error, "str"):
        first = redact(str(error.str()))  # its words, not KafkaError{code=…}
    name = error.name() if hasattr(error, "name") else ""
    if name.endswith("_AUTHORIZATION_FAILED") or name.endswith("AUTHENTICATION"):
        first = (
            f"{name}: the principal of the Kafka settings (--kafka-config) is refused; "
            "it needs an ACL for this operation (docs/security.md)"
        )
    elif name in {"_TRANSPORT", "_TIMED_OUT", "_ALL_BROKERS_DOWN"}:
        first = (
            f"no broker answered ({first}): check --bootstrap (or "
            "$KVLEDGER_KAFKA_BOOTSTRAP), that the broker runs (`scripts/services up` starts "
            "a local one), and the Kafka settings' TLS CA, SASL mechanism and credentials"
        )
    return what, first


def _interrupted(args: argparse.Namespace) -> int:
    """Ctrl-C: one line, not a traceback (-v shows where it was)."""
    if args.verbose:
        import traceback

        traceback.print_exc()
    print(f"kvledger {args.command}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
