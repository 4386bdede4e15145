"""This code's apply rate beside the release before the core split, in the same run.

The consumer's core was split into a pure planner and stores (issue 13); its promise was an
apply rate no worse than before. Here both versions run bench/consume's apply benchmark (the
same fleet, hence the same 41,024 messages), each in a process of its own, alternating
(previous, now) ``rounds`` times, so that the machine's drift falls on both alike. The
previous release is checked out from this repository's history into a temporary worktree
(skipped, and said so, when the history does not hold it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import record, settle

PREVIOUS = "0d19e10"  # the last release before the split (consumer/apply.py)
ROOT = Path(__file__).resolve().parent.parent
# Run in either checkout: the fleet's configuration moved from producer.simulate to
# kvledger.fleet in the split.
_RUN = """
import json, os
try:
    from kvledger.fleet import FleetConfig
except ImportError:
    from producer.simulate import FleetConfig
from bench.consume import apply_rate
print(json.dumps(apply_rate(os.environ["KVLEDGER_DATABASE_URL"],
                            FleetConfig(instances=4, requests=500, seed=21))))
"""
APPLY = "apply block-events/s (decode+validate+apply+offsets)"


def _run(checkout: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, "-c", _RUN], cwd=checkout, env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    figures: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def main(rounds: int = 5) -> dict[str, float]:
    server = os.environ["KVLEDGER_DATABASE_URL"]
    with tempfile.TemporaryDirectory(prefix="kvledger-previous-") as tmp:
        worktree = Path(tmp) / "previous"
        added = subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), PREVIOUS],
            check=False, capture_output=True, text=True,
        )  # fmt: skip
        if added.returncode != 0:
            print(f"previous release {PREVIOUS} not in this clone's history: skipped")
            return {}
        try:
            runs: dict[str, list[dict[str, float]]] = {"previous": [], "now": []}
            for _ in range(rounds):
                for who, checkout in (("previous", worktree), ("now", ROOT)):
                    settle(server)
                    runs[who].append(_run(checkout))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                           check=False, capture_output=True)  # fmt: skip
    figures: dict[str, float] = {"messages": runs["now"][0]["messages"]}
    for who, results in runs.items():
        figures[f"{who}: apply block-events/s (median of {rounds})"] = statistics.median(
            r[APPLY] for r in results
        )
        figures[f"{who}: ratio apply / raw COPY (median)"] = statistics.median(
            r["ratio apply / raw COPY"] for r in results
        )
    ratios = [n[APPLY] / p[APPLY] for p, n in zip(runs["previous"], runs["now"], strict=True)]
    figures["apply rate, now / previous (per round, median)"] = statistics.median(ratios)
    for i, ratio in enumerate(ratios, 1):
        figures[f"round {i}: now / previous"] = ratio
    record("consume_vs_previous", figures)
    return figures


if __name__ == "__main__":
    main()
