"""`make bench` states its figures in one dated place (bench.common.publish)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from bench.common import publish


def test_a_run_writes_dated_json_and_markdown_and_nothing_else(tmp_path: Path) -> None:
    figures = {"relay": {"vs_raw_receive": 0.61, "events_per_s": 1_234_567}}
    written = publish(figures, tmp_path, datetime(2026, 12, 1, 12, 0, tzinfo=UTC))
    assert [p.name for p in written] == ["2026-12-01.json", "2026-12-01.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-12-01.json", "2026-12-01.md"]
    data = json.loads((tmp_path / "2026-12-01.json").read_text())
    assert data["relay"] == figures["relay"] and data["run"]["date"] == "2026-12-01T12:00:00Z"
    table = (tmp_path / "2026-12-01.md").read_text()
    assert "| vs_raw_receive | 0.61 |" in table and "| events_per_s | 1,234,567 |" in table
