"""The whole pipeline through the CLI: simulate → Kafka → consume → PostgreSQL → lookup.

Services come from the conftest fixtures (environment, testcontainers where a Docker engine
answers, else scripts/services). Every stage runs as the `kvledger` command a user runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.consumer.db import connect
from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts
from kvledger.serving.lookup import rank
from tests.helpers.brute_force import brute_force
from tests.helpers.consuming import by_partition
from tests.helpers.reference_index import build, index_state

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def kvledger(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_simulate_consume_lookup(
    kafka_bootstrap, fresh_database, make_topic, group_id, tmp_path
) -> None:
    topic = make_topic("e2e", partitions=12)
    out = kvledger(
        "simulate", "--bootstrap", kafka_bootstrap, "--topic", topic, "--partitions", "12",
        "--instances", "4", "--requests", "60", "--seed", "23", "--misconfigured-source",
    )  # fmt: skip
    produced = int(next(ln for ln in out.splitlines() if ln.startswith("messages:")).split()[1])
    out = kvledger(
        "consume", "--bootstrap", kafka_bootstrap, "--database-url", fresh_database,
        "--topic", topic, "--consumer-group", group_id, "--dlq-topic", f"{topic}.dlq",
        "--until-caught-up",
    )  # fmt: skip
    assert f"consumed {produced} messages" in out
    assert "rejected block_size_mismatch:" in out

    # The exact final state, against the independent reference model of the same messages.
    ref = build(by_partition(kafka_bootstrap, topic, group_id + "-read", produced))
    with connect(fresh_database, autocommit=True) as conn:
        state = index_state(conn)
        rejected_sources = conn.execute(
            "SELECT DISTINCT source FROM kvledger.rejected_events"
        ).fetchall()
    assert state["blocks"] == ref.blocks
    assert state["residencies"] == ref.residencies()
    assert state["history"] == ref.history_multiset()
    assert state["rejected"] == ref.rejected and ref.rejected["block_size_mismatch"] > 0
    assert rejected_sources == [("engine-misconfigured",)]

    # A routing answer: the CLI's choice is the brute-force best holder of the prompt.
    fleet = FleetConfig(instances=4, requests=60, seed=23, misconfigured_source=True)
    prompt = system_prompts(fleet)[2] + [7] * 40
    tokens_file = tmp_path / "prompt.txt"
    tokens_file.write_text(" ".join(map(str, prompt)))
    out = kvledger(
        "lookup", "--database-url", fresh_database, "--model", fleet.model,
        "--token-ids", f"@{tokens_file}", "--silent-after", "3600",  # the fleet has stopped
    )  # fmt: skip
    want = brute_force(ref, prompt_hashes(prompt, fleet), set(ref.residencies()))
    assert want, "the prompt's system prefix is held somewhere"
    # "route to X (score S)", or "a N-way tie at score S: X, Y, ..." (a tie said as one).
    line = next(ln for ln in out.splitlines() if ln.startswith(("route to ", "a ")))
    best = rank(sorted(want, key=repr))
    tied = [r.instance for r in best if r.score == best[0].score]
    if len(tied) > 1:
        assert line.endswith(": " + ", ".join(tied)), line
    else:
        assert line.split()[2] == best[0].instance, line
    first = tied[0]
    answer = json.loads(kvledger(
        "lookup", "--database-url", fresh_database, "--model", fleet.model,
        "--token-ids", f"@{tokens_file}", "--silent-after", "3600", "--json",
    ))  # fmt: skip
    assert answer["ranked"][0]["instance"] == first
    assert {h["instance"] for h in answer["holders"]} >= {answer["ranked"][0]["instance"]}
