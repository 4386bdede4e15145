"""bench.peers_process: each peer as its user runs it, in a process of its own."""

from __future__ import annotations

import os

import pytest

from bench import peers_process
from bench.peers import _holders

if os.environ.get("CI") == "true":  # CI installs the dev extra: no skipping there
    import dynamo._core  # noqa: F401
else:
    pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime (the dev extra)")

CHAINS = 12
ANSWERS = 30


def test_each_side_in_its_own_process_reports_memory_rates_and_the_same_answers() -> None:
    figures = peers_process.measure(chains=CHAINS, lookups=240, kinds=("router", "dynamo"))
    blocks = sum(n for c in range(CHAINS) for _, n in _holders(c))
    for side in ("router, public path", "Dynamo's binding"):
        name = f"as run, {side}"
        assert figures[f"{name}: stored blocks applied"] == blocks
        assert figures[f"{name}: RSS before the index, MiB"] > 10  # an interpreter at least
        grown = figures[f"{name}: RSS growth after answering, MiB"]
        assert 0 < grown < 200  # the index took memory, and not absurdly much
        assert figures[f"{name}: peak RSS growth (VmHWM), MiB"] >= grown
        assert figures[f"{name}: apply, block events/s"] > 1000
        p50 = figures[f"{name}: lookup by tokens: p50 us"]
        assert 0 < p50 <= figures[f"{name}: lookup by tokens: p99 us"]
    router, dyn = "as run, router, public path", "as run, Dynamo's binding"
    assert figures[f"{router}: same answers as Dynamo's binding (200 prompts)"] == 1.0
    assert figures[f"{router} / Dynamo's binding: apply rate"] == pytest.approx(
        figures[f"{router}: apply, block events/s"] / figures[f"{dyn}: apply, block events/s"]
    )
    assert "as run, router, public path, with --dynamo-api: stored blocks applied" not in figures
    shown = peers_process.table(figures)
    assert "router / dynamo" in shown and "same answers as Dynamo's binding: True" in shown


def test_a_side_answers_as_its_index_holds() -> None:
    # In this process (the figures' memory is this test run's): the answers themselves.
    side = peers_process.run_side("router", CHAINS, ANSWERS)
    assert side["blocks"] == sum(n for c in range(CHAINS) for _, n in _holders(c))
    picked = peers_process._prompts(CHAINS, ANSWERS)
    for c, answer in zip(picked, side["answers"], strict=True):
        assert answer == sorted([w, n] for w, n in _holders(c))  # each holder its whole run


def test_runs_combine_best_timings_median_memory_and_only_agreeing_answers() -> None:
    run = {"blocks": 10, "apply_s": 3.0, "p50_us": 5.0, "answers": [[[0, 3]]]}
    slow = run | {"blocks": 20, "apply_s": 4.0, "p50_us": 9.0}
    fast = run | {"blocks": 12, "apply_s": 2.0, "p50_us": 7.0}
    # Timings the best run's, memory the median run's.
    assert peers_process._combine([run, slow, fast]) == run | {"blocks": 12, "apply_s": 2.0}
    assert peers_process._combine([run, run | {"answers": [[[0, 2]]]}])["answers"] is None


def test_an_unknown_side_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown side 'sglang'"):
        peers_process.run_side("sglang", CHAINS, ANSWERS)
