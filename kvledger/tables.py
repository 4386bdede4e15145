"""Plain-text tables for the CLI and the demo."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> None:
    """Columns padded to their widest cell, a rule under the header; None prints empty."""
    cells = [list(header)] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print(indent + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print(indent + "  ".join("-" * w for w in widths))
