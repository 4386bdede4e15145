"""Every page of the docs stays easy to read (issue 75's point 15): no sentence over 40
words and no table cell over 30, outside code, in README.md and every docs/*.md, generated
parts included. A new page is held from the day it lands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(["README.md", *(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))])
MAX_SENTENCE, MAX_CELL = 40, 30
_SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z`(\[*])")


def prose(text: str) -> tuple[list[str], list[str]]:
    """(sentences, table cells) of a Markdown page, code blocks and headings left out."""
    sentences: list[str] = []
    cells: list[str] = []
    paragraph: list[str] = []
    fenced = False

    def flush() -> None:
        if paragraph:
            sentences.extend(_SENTENCE_END.split(" ".join(paragraph)))
            paragraph.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            flush()
            continue
        if fenced or stripped.startswith(("#", "<!--")):
            continue
        if stripped.startswith("|"):
            flush()
            cells.extend(c.strip() for c in stripped.strip("|").split("|"))
        elif not stripped or re.match(r"([-*]|\d+\.)\s", stripped):
            flush()
            if stripped:
                paragraph.append(re.sub(r"^([-*]|\d+\.)\s+", "", stripped))
        else:
            paragraph.append(stripped)
    flush()
    return sentences, cells


def _words(text: str) -> int:
    return len(text.split())


def test_the_checker_finds_a_long_sentence_and_a_long_cell() -> None:
    long = " ".join(["Word"] * 41)
    sentences, cells = prose(
        f"Short one. {long}.\n\n| a | {' '.join(['w'] * 31)} |\n```\n{long}\n```\n"
    )
    assert [_words(s) for s in sentences] == [2, 41]
    assert max(_words(c) for c in cells) == 31


@pytest.mark.parametrize("page", PAGES)
def test_a_page_reads_easily(page: str) -> None:
    sentences, cells = prose((ROOT / page).read_text())
    assert len(sentences) + len(cells) > 20  # the checker found the page's prose
    assert [s for s in sentences if _words(s) > MAX_SENTENCE] == []
    assert [c for c in cells if _words(c) > MAX_CELL] == []
