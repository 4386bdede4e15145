"""The ``kvledger`` command: configuration is read here, at the edge, and passed inward."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial

from confluent_kafka import KafkaException

from kvledger import __version__, envopts
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.redact import redact

# The command modules, the functions that add their parsers, the commands they add, and the
# extra that installs what they need. A base install (the producer alone) still lists every
# command; one whose extra is missing says which to install.
_COMMANDS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], str], ...] = (
    ("simulate_cmd", ("add_parser",), ("simulate",), ""),
    ("consumer_cmds", ("add_parsers", "add_reliability_parsers"),
     ("migrate", "consume", "groups", "dlq", "verify", "rebuild"), "consumer"),
    ("demo", ("add_parser",), ("demo",), "all"),
    ("lookup_cmds", ("add_parsers",), ("serve", "lookup"), "lookup"),
    ("sources_cmd", ("add_parser",), ("sources",), "consumer"),
    ("relay_cmd", ("add_parser",), ("relay",), "relay"),
    ("roles_cmd", ("add_parser",), ("roles",), "consumer"),
)  # fmt: skip

# A module missing at run time → the extra that brings it.
_EXTRA_OF = {
    "psycopg": "consumer", "psycopg_pool": "consumer", "sqlalchemy": "consumer",
    "alembic": "consumer", "prometheus_client": "consumer", "starlette": "lookup",
    "uvicorn": "lookup", "zmq": "relay", "msgspec": "relay", "authlib": "registry",
    "httpx": "registry", "attrs": "registry", "cachetools": "registry",
}  # fmt: skip


def _needs(command: str, extra: str, module: str | None, args: argparse.Namespace) -> int:
    print(
        f"kvledger {command}: this install lacks {module or 'a dependency'}: "
        f"pip install 'kvledger[{extra}]'",
        file=sys.stderr,
    )
    return 1


def _add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for module, adders, names, extra in _COMMANDS:
        try:
            commands = importlib.import_module(f"kvledger.{module}")
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in _EXTRA_OF:
                raise  # not a missing extra: a broken install, shown as it is
            for name in names:
                p = subparsers.add_parser(
                    name, help=f"(not installed: pip install 'kvledger[{extra}]')",
                    add_help=False,
                )  # fmt: skip
                p.add_argument("rest", nargs=argparse.REMAINDER, help="its arguments")
                p.set_defaults(run=partial(_needs, name, extra, exc.name))
            continue
        for adder in adders:
            getattr(commands, adder)(subparsers)


def _usual_errors() -> tuple[type[BaseException], ...]:
    """The failures printed as one line: Kafka's, kvledger's, and PostgreSQL's when the
    consumer extra is installed."""
    errors: list[type[BaseException]] = [KafkaException, KvledgerError]
    try:
        import psycopg

        errors.append(psycopg.OperationalError)
    except ModuleNotFoundError:
        pass
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvledger", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"kvledger {__version__}")
    parser.add_argument(
        "-v", "--verbose", "--debug", dest="verbose", action="store_true",
        help="debug logging, and the traceback of an error (else one line)",
    )  # fmt: skip
    parser.add_argument(
        "--log-format", choices=("text", "json"), default="text",
        help="log lines as text, or as one JSON object each (for log collectors)",
    )  # fmt: skip
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_commands(subparsers)
    envopts.bind(parser)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    if not args.verbose:
        logging.getLogger("alembic").setLevel(logging.WARNING)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        result: int = args.run(args)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if args.verbose or root not in _EXTRA_OF:
            raise
        return _needs(args.command, _EXTRA_OF[root], root, args)
    except _usual_errors() as exc:
        if args.verbose:
            raise
        # The usual failures (a database or broker that does not answer, a refused operation)
        # in one line; -v shows the traceback.
        what = "Kafka" if isinstance(exc, KafkaException) else (
            "error" if isinstance(exc, KvledgerError) else "database"
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
