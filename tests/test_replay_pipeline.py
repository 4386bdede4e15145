"""`kvledger replay` with its live pipeline on a real broker: the simulated engines' events go
through kvledger's producer library into Kafka, the router index learns from them only, and
at the end it holds exactly what the engines' caches hold; Ctrl-C stops the replay and
leaves no topic behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from kvledger.replay.pipeline import Pipeline
from kvledger.replay.run import ReplayConfig, replay
from tests.helpers.traces import conversation_trace

pytestmark = pytest.mark.integration


def _replay_topics(admin: AdminClient) -> set[str]:
    return {t for t in admin.list_topics(timeout=10).topics if t.startswith("kvledger-replay-")}


def test_the_index_learns_exactly_what_the_engines_hold(
    tmp_path: Path, kafka_bootstrap: str, kafka_admin: AdminClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = conversation_trace(tmp_path / "t.jsonl", conversations=40, gap_ms=300)
    before = _replay_topics(kafka_admin)
    seen: dict[str, object] = {}
    original = Pipeline.held

    def held(self: Pipeline, model: str, names: list[str]) -> dict[tuple[str, str], set[bytes]]:
        seen[model] = answer = original(self, model, names)
        return answer

    monkeypatch.setattr(Pipeline, "held", held)
    config = ReplayConfig(
        path, engines=3, tokens_per_engine=16 * 512, gpu_share=0.25, speed=60,
        policies=("kvledger_gpu", "kvledger_tiered", "dynamo", "global_pool"),
        bootstrap=kafka_bootstrap,
    )  # fmt: skip
    result = replay(config)
    figures = result.pipeline
    assert figures["index_differences"] == 0
    assert figures["index_blocks_compared"] > 50
    assert figures["messages"] > 100 and figures["lag_ms_p99"] > 0
    # Both tiers were learned (the engines' CPU tiers filled, and lost blocks past 16).
    tiered = seen["replay-kvledger_tiered"]
    assert isinstance(tiered, dict)
    assert all(tiered[(f"kvledger_tiered-e{i:03d}", "CPU")] for i in range(3))
    assert max(len(tiered[(f"kvledger_tiered-e{i:03d}", "CPU")]) for i in range(3)) == 16
    # The tiered policy found what the engines had offloaded.
    assert result.tallies["kvledger_tiered"].cpu_tokens > 0
    assert result.tallies["kvledger_tiered"].hit_rate > result.tallies["kvledger_gpu"].hit_rate
    assert _replay_topics(kafka_admin) == before  # its topic removed


def test_ctrl_c_stops_the_replay_and_removes_its_topic(
    tmp_path: Path, kafka_bootstrap: str, kafka_admin: AdminClient
) -> None:
    path = conversation_trace(tmp_path / "t.jsonl", conversations=400, gap_ms=2000)
    before = _replay_topics(kafka_admin)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger", "replay", str(path), "--speed", "1", "--engines", "4",
         "--policies", "kvledger_tiered,round_robin", "--bootstrap", kafka_bootstrap,
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("trace:")
    deadline = time.monotonic() + 60
    while not _replay_topics(kafka_admin) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _replay_topics(kafka_admin) - before, "the replay made no topic"
    time.sleep(2)  # replaying
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "kvledger replay: interrupted"
    deadline = time.monotonic() + 30
    while _replay_topics(kafka_admin) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _replay_topics(kafka_admin) == before
    assert not (tmp_path / "out").exists()
