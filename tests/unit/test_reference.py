"""docs/reference.md's commands and options are the parser's own (kvledger/reference.py):
the page is what `python -m kvledger.reference` makes of it, every command is on it, and a
help text changed in the parser changes the page."""

from __future__ import annotations

from kvledger import envopts
from kvledger.cli import build_parser
from kvledger.reference import PAGE, current, page_with, render


def test_the_page_is_what_the_parser_makes() -> None:
    assert PAGE.read_text() == current(), "docs/reference.md: run python -m kvledger.reference"


def test_every_command_and_option_is_on_the_page() -> None:
    parser = build_parser(environ={})
    page = PAGE.read_text()
    for path, sub in envopts.commands(parser):
        assert f"### `{' '.join(['kvledger', *path])}`" in page, path
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, (path, option)


def test_a_help_text_changed_in_the_parser_changes_the_page() -> None:
    parser = build_parser(environ={})
    before = render(parser)
    for path, sub in envopts.commands(parser):
        if path == ["consume"]:
            for action in sub._actions:
                if "--batch-size" in action.option_strings:
                    action.help = "a new meaning [env KVLEDGER_CONSUME_BATCH_SIZE; default 9]"
    after = render(parser)
    assert after != before and "| a new meaning | `KVLEDGER_CONSUME_BATCH_SIZE` | `9` |" in after
    assert page_with(after, PAGE.read_text()) != PAGE.read_text()


def test_every_docs_page_a_help_text_or_module_names_exists() -> None:
    """A help text or docstring that sends the reader to docs/X.md names a page that is
    there (`republish --help` once named docs/republish.md, which never was)."""
    import re

    root = PAGE.parent.parent
    named: set[str] = set(re.findall(r"docs/[\w-]+\.md", render(build_parser(environ={}))))
    for folder in ("kvledger", "consumer", "serving", "producer", "schemas"):
        for path in (root / folder).rglob("*.py"):
            named.update(re.findall(r"docs/[\w-]+\.md", path.read_text()))
    missing = sorted(n for n in named if not (root / n).is_file())
    assert not missing, f"named but not there: {missing}"
