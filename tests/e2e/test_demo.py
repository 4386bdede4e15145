"""`kvledger demo`, the main job, as `make demo` runs it: its report reconciles and reads
alone (no log line beside it), a tie is called a tie, and its hints name commands that run."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from kvledger.consumer.db import drop_database

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo_name(kafka_admin: AdminClient, database_url: str) -> Iterator[str]:
    """A name of this test's for the demo's database, topics and group (the demo's own,
    kvledger_demo and kv-events-demo, are a user's), removed afterwards."""
    name = f"t_{uuid.uuid4().hex[:10]}"
    yield name
    topics = [f"kv-events-{name}", f"kv-events-{name}.dlq"]
    for future in kafka_admin.delete_topics(topics).values():
        with contextlib.suppress(Exception):
            future.result(timeout=30)
    server = sa.engine.make_url(database_url)
    drop_database(database_url, f"{server.database or 'kvledger'}_{name}")


def test_the_demo_report_reconciles_and_stands_alone(
    kafka_bootstrap: str, database_url: str, demo_name: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvledger", "demo", "--bootstrap", kafka_bootstrap,
         "--database-url", database_url, "--requests", "60", "--name", demo_name],
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
        r"of engine-\d's events, (\d+) group announcements and (\d+) heartbeat",
        out,
    )
    produced = re.search(r"   (\d+) messages produced, (\d+) acknowledged", out)
    assert read and parts and produced, out
    assert int(read[1]) == int(parts[1]) + int(parts[2]) == int(read[2]) + int(read[3])
    assert int(parts[1]) == int(produced[1])
    assert int(parts[2]) == int(parts[3]) + int(parts[4]) + int(parts[5])
    relayed = re.search(r"(\d+) messages relayed", out)
    assert relayed and int(relayed[1]) == int(parts[3])
    # The decision says "tie" exactly when the two best scores are equal.
    scores = re.findall(r"   \d+\. \S+  score ([\d,]+)", out)
    [decision] = [ln for ln in out.splitlines() if ln.startswith("   → ")]
    assert ("-way tie at score" in decision) == (len(scores) > 1 and scores[0] == scores[1])
    assert "   .venv/bin/kvledger sources --database-url" in out and "make demo KEEP=1" in out
    assert f"topic kv-events-{demo_name} " in out and "kvledger_demo" not in out
    # Each line under the section it explains: the misconfigured engine's blocks are said to
    # be its partial tails, and the run's middle sits under the audit that uses it.
    assert "engine-misconfigured holds" in out and "partial tail(s)" in out
    middle, refused = out.index("(the middle of the run:"), out.index("== audit: which sources")
    assert out.index("== audit: what did engine-1 hold") < middle < refused
    # Every SQL statement printed can be pasted into psql: no driver placeholders.
    assert "%(" not in out and "WHERE r.instance = 'engine-" in out
