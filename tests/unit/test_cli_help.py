"""The command explains itself: every subcommand and option has help, and the usual
failures are one line, not a traceback."""

from __future__ import annotations

import argparse

import pytest

from kvledger.cli import build_parser, main


def _walk(parser: argparse.ArgumentParser, path: list[str]) -> list[tuple[str, str, str]]:
    """(command, option or subcommand, its help) for everything the parser offers."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((" ".join(path), name, helps.get(name, "")))
                out += _walk(sub, [*path, name])
        elif action.option_strings and action.dest != "help":
            out.append((" ".join(path), action.option_strings[0], action.help or ""))
    return out


def test_every_subcommand_and_option_has_help() -> None:
    offered = _walk(build_parser(), ["kvledger"])
    assert len(offered) > 100
    assert [(cmd, name) for cmd, name, text in offered if not text.strip()] == []


def test_an_unreachable_database_is_one_line_with_no_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "postgresql+psycopg://kv:s3cret@127.0.0.1:1/db"
    assert main(["sources", "--database-url", url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvledger sources: database: ")
    assert "s3cret" not in err and "Traceback" not in err
