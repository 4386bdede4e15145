"""Every option of every command can come from the environment (containers set variables,
not command lines): ``KVLEDGER_<COMMAND>_<OPTION>``, e.g. ``KVLEDGER_CONSUME_BATCH_SIZE`` for
``kvledger consume --batch-size``, ``KVLEDGER_GROUPS_DECLARE_MODEL`` for ``kvledger groups
declare --model``. A command-line flag wins over the variable, the variable over the default.
Options whose help already names a variable (the shared ones: ``$KVLEDGER_KAFKA_BOOTSTRAP``,
``$KVLEDGER_DATABASE_URL``, ``$KVLEDGER_KAFKA_CONFIG``, …) are resolved by the command itself.
Each option's help ends with its variable and its default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from typing import Any

PREFIX = "KVLEDGER"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def variable(command: list[str], option: str) -> str:
    """The variable of ``option`` (``--batch-size``) under ``command`` (``["consume"]``)."""
    words = [PREFIX, *command, option.lstrip("-")]
    return "_".join(w.upper().replace("-", "_") for w in words)


def bind(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Give every option of ``parser``'s subcommands its variable: as its default when set,
    and in its help."""
    env = os.environ if environ is None else environ
    for command, sub in [([], parser), *_commands(parser, [])]:
        for action in sub._actions:
            if not action.option_strings or action.dest in {"help", "version"}:
                continue
            if action.help == argparse.SUPPRESS:
                continue
            text = action.help or ""
            if "$KVLEDGER_" in text:  # resolved by the command (a shared setting)
                continue
            name = variable(command, action.option_strings[-1])
            if name in env:
                _apply(sub, action, name, env[name])
            action.help = f"{text} [env {name}{_default(action)}]"


def known(parser: argparse.ArgumentParser) -> set[str]:
    """Every variable an option of ``parser`` reads: its own, and the shared settings its
    help names (``$KVLEDGER_…``), each also as ``…_FILE``."""
    import re

    out: set[str] = set()
    for command, sub in [([], parser), *_commands(parser, [])]:
        for action in sub._actions:
            if not action.option_strings:
                continue
            out.add(variable(command, action.option_strings[-1]))
            out.update(re.findall(r"\$(KVLEDGER_[A-Z0-9_]+)", action.help or ""))
    return out | {f"{name}_FILE" for name in out}


def commands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """``parser`` itself (path ``[]``), then every command and action, depth first."""
    yield [], parser
    yield from _commands(parser, [])


def _commands(
    parser: argparse.ArgumentParser, path: list[str]
) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                yield [*path, name], sub
                yield from _commands(sub, [*path, name])


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is False or default in ([], argparse.SUPPRESS):
        return ""
    if isinstance(action, argparse._StoreTrueAction):
        return ""
    return f"; default {default}"


def _apply(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> None:
    """``raw`` as the action's default, converted and checked as a flag's value would be."""
    value: Any
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            parser.error(f"${name}: expected true or false, not {raw!r}")
        on = word in _TRUE
        value = on if isinstance(action, argparse._StoreTrueAction) else not on
    elif isinstance(action, argparse._AppendAction):
        value = [
            _convert(parser, action, name, part.strip()) for part in raw.split(",") if part.strip()
        ]
    elif isinstance(action, argparse._CountAction):
        value = _convert(parser, action, name, raw, int)
    else:
        value = _convert(parser, action, name, raw)
        if action.nargs in ("+", "*"):
            value = [_convert(parser, action, name, p) for p in raw.split()]
    action.default = value
    action.required = False


def _convert(
    parser: argparse.ArgumentParser,
    action: argparse.Action,
    name: str,
    raw: str,
    kind: Any = None,
) -> Any:
    kind = kind or action.type or str
    try:
        value = kind(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"${name}: {raw!r} is not a valid value ({exc})")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        parser.error(f"${name}: {raw!r} is not one of {choices}")
    return value
