"""The reference pages say what the code does: docs/metrics.md lists every metric each
process registers and docs/http.md every route of the OpenAPI document. A metric or route
added without its page fails here (scripts/docs-reference rewrites the pages)."""

from __future__ import annotations

import pytest

from tests.helpers.doc_reference import BEGIN, END, ROOT, SECTIONS, generated, rewritten


@pytest.mark.parametrize("page", sorted(SECTIONS))
def test_the_page_lists_what_the_code_has(page: str) -> None:
    text = (ROOT / page).read_text()
    assert generated(text) == SECTIONS[page](), f"{page} is out of date: run scripts/docs-reference"


def test_a_new_metric_would_be_caught() -> None:
    page = (ROOT / "docs/metrics.md").read_text()
    part = generated(page)
    assert part is not None and "`kvledger_messages_applied_total` | counter" in part
    stale = part.replace("| `kvledger_messages_applied_total`", "| `kvledger_renamed_total`")
    assert generated(rewritten(page, stale)) != SECTIONS["docs/metrics.md"]()
    assert rewritten(page, part) == page and page.count(BEGIN) == page.count(END) == 1
