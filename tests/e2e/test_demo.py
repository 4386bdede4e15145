"""`kvledger demo`, the main job, as `make demo` runs it: its report reconciles and reads
alone (no log line beside it), a tie is called a tie, and its hints name commands that run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_report_reconciles_and_stands_alone(
    kafka_bootstrap: str, database_url: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvledger", "demo", "--bootstrap", kafka_bootstrap,
         "--database-url", database_url, "--requests", "60"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # The report is the output: beside it at most a warning of something gone wrong, never
    # the progress logs (INFO) or a traceback.
    assert " INFO " not in done.stderr and "Traceback" not in done.stderr, done.stderr[:2000]
    assert len(done.stderr.splitlines()) <= 3, done.stderr[:2000]
    # What the consumer read is what the publishers and the relay produced.
    read = re.search(r"   (\d+) messages: (\d+) applied, (\d+) rejected, (\d+) duplicate", out)
    parts = re.search(
        r"   = (\d+) the simulated engines' publishers produced \+ (\d+) from the relay \((\d+) "
        r"of engine-\d's events, (\d+) group announcements",
        out,
    )
    produced = re.search(r"   (\d+) messages produced, (\d+) acknowledged", out)
    assert read and parts and produced, out
    assert int(read[1]) == int(parts[1]) + int(parts[2]) == int(read[2]) + int(read[3])
    assert int(parts[1]) == int(produced[1]) and int(parts[2]) == int(parts[3]) + int(parts[4])
    relayed = re.search(r"(\d+) messages relayed", out)
    assert relayed and int(relayed[1]) == int(parts[3])
    # The decision says "tie" exactly when the two best scores are equal.
    scores = re.findall(r"   \d+\. \S+  score ([\d,]+)", out)
    [decision] = [ln for ln in out.splitlines() if ln.startswith("   → ")]
    assert ("-way tie at score" in decision) == (len(scores) > 1 and scores[0] == scores[1])
    assert "   .venv/bin/kvledger sources --database-url" in out and "make demo KEEP=1" in out
