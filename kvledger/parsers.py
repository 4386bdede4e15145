"""The command's parser machinery: the parser class every command uses (its errors), the
lazy reference to a command's code, and the walk over every parser. The arguments of each
command are in kvledger.arguments. Building the parser imports no server dependency, so
`kvledger --help` and `kvledger COMMAND --help` start at once and work on the base install;
each command's code lives in its own module (``consumer_cmds``, ``lookup_cmds``, ...) and is
imported when the command runs, and a command whose extra is not installed says which to
install, when it runs and in its help.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)'")
# An extra → a module it installs that its commands import (found without importing it).
_EXTRA_PROBE = {"consumer": "psycopg", "lookup": "starlette", "relay": "zmq"}


def bounded(
    kind: type[int] | type[float], low: float, high: float | None = None
) -> Callable[[str], Any]:
    """An option's type: a number of ``kind`` in [low, high], refused with the range (a
    batch size of 0 or -5, a port past 65535, a NaN interval) before the command runs."""
    word = "an integer" if kind is int else "a number"
    span = f"at least {low:g}" + (f" and at most {high:g}" if high is not None else "")

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {word}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {span}")
        return value

    parse.__name__ = kind.__name__
    return parse


COUNT = bounded(int, 1)  # how many of something: at least one
NON_NEGATIVE = bounded(int, 0)
PORT = bounded(int, 1, 65535)
PORT_OR_OFF = bounded(int, 0, 65535)  # 0: off
SECONDS = bounded(float, 0.001)  # an interval or a timeout
SECONDS_OR_OFF = bounded(float, 0)  # 0: never


class Parser(argparse.ArgumentParser):
    """argparse with the errors a newcomer can act on: no abbreviated options (a prefix of
    one option must never be taken for another), an unknown option reported by the command
    it was given to with the closest real one, and a missing subcommand named by its
    choices."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        if not self._subcommands():
            # A leaf command: an unknown option is reported here, before a required option
            # it may be the misspelling of, and with this command's usage.
            for word in words:
                if word == "--":
                    break
                option = word.split("=", 1)[0]
                unknown = option not in self._option_string_actions
                if unknown and option.startswith("-") and option[1:2] not in "0123456789":
                    self.error(f"unrecognized argument: {option}{self._suggest(option)}")
        return super().parse_known_args(words, namespace)

    def error(self, message: str) -> NoReturn:
        action = self._subcommands()
        if action is not None and message.startswith("the following arguments are required"):
            choices = ", ".join(action.choices)
            message = f"a command is required: one of {choices}"
        elif action is not None and (wrong := _INVALID_CHOICE.search(message)):
            close = difflib.get_close_matches(wrong.group(1), list(action.choices), n=1)
            if close:
                message = f"{message} (did you mean {close[0]}?)"
        super().error(message)

    def _subcommands(self) -> argparse._SubParsersAction[Any] | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action
        return None

    def _suggest(self, option: str) -> str:
        if option == "--group" and "--consumer-group" in self._option_string_actions:
            return " (--consumer-group names the Kafka consumer group; --group is a KV-cache group)"
        close = difflib.get_close_matches(option, list(self._option_string_actions), n=1)
        return f" (did you mean {close[0]}?)" if close else ""


if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[Parser]


def command(target: str) -> Callable[[argparse.Namespace], int]:
    """The function ``module:name`` of a command module, imported when the command runs
    (a module its extra brings that is missing then is named by kvledger.cli)."""
    module, _, name = target.partition(":")

    def run(args: argparse.Namespace) -> int:
        fn = getattr(importlib.import_module(f"kvledger.{module}"), name)
        result: int = fn(args)
        return result

    return run


def _installed(extra: str) -> bool:
    probes: list[str | None]
    if extra == "all":
        probes = list(_EXTRA_PROBE.values())
    elif extra == "republish":  # the consumer's and the relay's
        probes = [_EXTRA_PROBE["consumer"], _EXTRA_PROBE["relay"]]
    else:
        probes = [_EXTRA_PROBE.get(extra)]
    return all(p is None or importlib.util.find_spec(p) is not None for p in probes)


def add(subparsers: Subparsers, name: str, extra: str, help: str, **kw: Any) -> Parser:
    if extra and not _installed(extra):
        help = f"{help} (not installed: pip install 'kvledger[{extra}]')"
    return subparsers.add_parser(name, help=help, **kw)


def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from walk(sub)
