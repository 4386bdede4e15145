"""The lab's report of its decision routers (no services, no engines): kvledger's own
record of each run's decisions is tabled beside the lab's figure, and the dashboard's
picture is copied beside the results and shown, in place of an earlier run's of the same
name; a run without decisions adds nothing."""

from __future__ import annotations

from pathlib import Path

from bench.lab.run import Record, _decisions_section, summarize


def _run(name: str, picture: Path | None, captured_over_available: float) -> dict[str, object]:
    run: dict[str, object] = {"router": name, "all": {"captured_over_available": 0.99}}
    run["kvledger_funnel"] = {
        "decisions": 120, "prompt_blocks": 2400, "available_blocks": 1500,
        "captured_blocks": 1455, "captured_over_available": captured_over_available,
        "delivered_blocks": 1400, "delivered_known": 120,
        "outcomes": {"captured": 110, "chosen_elsewhere": 6, "no_holder": 4},
    }  # fmt: skip
    run["dashboard_picture"] = None if picture is None else str(picture)
    run["decision_reports"] = {"reported": 121, "sent": 118, "failed": 2, "expired": 1,
                               "dropped": 0, "last_error": None}  # fmt: skip
    return run


def test_the_decision_routers_are_tabled_with_their_dashboard(tmp_path: Path) -> None:
    taken = tmp_path / "logs" / "dashboard-kvledger-decisions.png"
    taken.parent.mkdir()
    taken.write_bytes(b"\x89PNG picture")
    out = tmp_path / "results"
    out.mkdir()
    earlier = out / "lab-2026-12-05-dashboard-kvledger-decisions-x3.png"  # an earlier run's
    earlier.write_bytes(b"\x89PNG old")
    other = out / "lab-2026-12-05-kv64-dashboard-kvledger-decisions-x3.png"  # another variant
    other.write_bytes(b"\x89PNG kept")
    lines: list[str] = []
    runs = [
        {"router": "round robin", "all": {"captured_over_available": 0.75}},
        _run("kvledger + decisions", taken, 0.97),
        _run("kvledger + decisions x3", None, 0.95),  # no browser: no picture
    ]
    pictures = _decisions_section(runs, out, "2026-12-05", lines)

    copied = out / "lab-2026-12-05-dashboard-kvledger-decisions.png"
    assert pictures == [copied] and copied.read_bytes() == b"\x89PNG picture"
    assert not earlier.exists() and other.read_bytes() == b"\x89PNG kept"
    rows = [line for line in lines if line.startswith("| kvledger")]
    assert len(rows) == 2 and not any("round robin" in line for line in lines)
    assert rows[0].split(" | ")[1:7] == ["120", "1500", "1455", "1400", "0.97", "0.99"]
    assert rows[1].split(" | ")[5] == "0.95"
    assert "captured 110, chosen_elsewhere 6, no_holder 4" in rows[0]
    assert rows[0].endswith("| 118 / 2 / 1 / 0 |")  # what became of the router's reports
    assert f"![{copied.stem}]({copied.name})" in lines


def test_a_lab_without_decision_routers_adds_no_section(tmp_path: Path) -> None:
    lines: list[str] = []
    runs = [{"router": "kvledger", "all": {"captured_over_available": 0.97}}]
    assert _decisions_section(runs, tmp_path, "2026-12-05", lines) == [] and lines == []


def _record(at: float, engine: int = 0, dead: int = -1, dead_at: float = 0.0) -> Record:
    return Record(at, "chat", engine, 1 + (dead >= 0), True, dead >= 0, dead, dead_at, 0.01,
                  64, 32, 32, "")  # fmt: skip


class _NoCounters:
    hits = queries = 0.0


def test_a_flapping_engines_window_runs_to_the_end_and_each_kill_restarts_the_clock() -> None:
    """Engine 1 killed at 10 s and again at 70 s: a request it refused 2 s after the second
    kill is within kvledger's liveness window (not late), one refused 30 s after it is late;
    the flapping window holds every request from the first kill on."""
    records = [
        _record(5.0),
        _record(50.0, dead=1, dead_at=50.0),  # 40 s after the first kill: late
        _record(72.0, dead=1, dead_at=72.0),  # 2 s after the second: within the window
        _record(100.0, dead=1, dead_at=100.0),  # 30 s after it: late
    ]
    kills = [(1, 10.0), (1, 70.0)]
    summary = summarize("r", records, _NoCounters(), {"engine_flapping": 10.0}, kills)  # type: ignore[arg-type]
    flapping = summary["windows"]["engine_flapping"]
    assert flapping["requests"] == 3 and summary["windows"]["steady"]["requests"] == 1
    assert (flapping["sent_to_dead_engine"], flapping["sent_to_dead_after_window"]) == (3, 2)
    assert summary["kills_at_s"] == [10.0, 70.0]
