"""`kvledger replay` without services: the trace's checks, the simulated engines' caches and
costs, what the fleets' sinks learn, and the bounds every policy must stay within."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.replay.engines import CPU, GPU, Engine, Tier, TimeModel
from kvledger.replay.fleet import Fleet, FleetShape, KnownState
from kvledger.replay.run import ReplayConfig, replay
from kvledger.replay.trace import TraceError, check_trace, read_trace
from tests.helpers.traces import conversation_trace

OFFLINE = ("round_robin", "least_loaded", "cache_aware", "dynamo", "mooncake_local", "oracle",
           "global_pool")  # fmt: skip
GOOD = {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}


def _trace(tmp_path: Path, *records: object) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ("{not json\n", "not JSON"),
        ([1, 2], "not a JSON object but list"),
        ({**GOOD, "input_length": -3}, "field 'input_length' is negative (-3)"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "field 'hash_ids' is missing"),
        ({k: v for k, v in GOOD.items() if k != "timestamp"}, "field 'timestamp' is missing"),
        ({**GOOD, "output_length": "5"}, "field 'output_length' must be an integer"),
        ({**GOOD, "output_length": True}, "field 'output_length' must be an integer"),
        ({**GOOD, "hash_ids": [1, -2, 3]}, "hash_ids[1] must be an integer"),
        ({**GOOD, "hash_ids": [1]}, "hash_ids has 1 ids for 1100 tokens"),
        ({**GOOD, "timestamp": 5}, None),  # fine: time goes on
    ],
)
def test_a_bad_line_is_refused_with_its_number_and_field(
    tmp_path: Path, bad: object, said: str | None
) -> None:
    path = _trace(tmp_path, {**GOOD, "timestamp": 5}, "\n", bad)
    if said is None:
        assert check_trace(path).requests == 2
        return
    with pytest.raises(TraceError) as caught:
        check_trace(path)
    assert caught.value.line == 3
    assert said in caught.value.reason
    assert str(caught.value).startswith(f"{path}:3: ")


def test_time_going_back_and_an_empty_trace_are_refused(tmp_path: Path) -> None:
    path = _trace(tmp_path, {**GOOD, "timestamp": 9}, {**GOOD, "timestamp": 8})
    with pytest.raises(TraceError, match=r":2: field 'timestamp' goes back \(8 after 9\)"):
        list(read_trace(path))
    with pytest.raises(TraceError, match="holds no request"):
        check_trace(_trace(tmp_path, "\n"))


def test_nothing_is_replayed_when_a_late_line_is_bad(tmp_path: Path) -> None:
    path = conversation_trace(tmp_path / "t.jsonl", conversations=20)
    lines = path.read_text().splitlines()
    lines[-1] = lines[-1].replace('"output_length": 8', '"output_length": -1')
    path.write_text("\n".join(lines) + "\n")
    played: list[int] = []
    with pytest.raises(TraceError, match=f":{len(lines)}: field 'output_length' is negative"):
        replay(
            ReplayConfig(path, policies=("round_robin",), speed=1e9), lambda d, t: played.append(d)
        )
    assert played == []


def test_the_command_says_the_bad_line_in_one_line(tmp_path: Path) -> None:
    path = _trace(tmp_path, GOOD, {**GOOD, "input_length": -1})
    done = subprocess.run(
        [sys.executable, "-m", "kvledger", "replay", str(path), "--policies", "round_robin",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"kvledger replay: error: {path}:2: field 'input_length' is negative (-1)"
    ]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def _engine(gpu: int, cpu: int) -> Engine:
    return Engine(0, Tier(GPU, gpu), Tier(CPU, cpu), TimeModel(), 4)


def test_a_prompt_served_again_hits_its_blocks_but_computes_its_last_token() -> None:
    engine = _engine(8, 16)
    first, changes = engine.serve((1, 2, 3), 12, now=0.0)
    assert (first.gpu_tokens, first.cpu_tokens, first.computed_tokens) == (0, 0, 12)
    assert [(c.medium, c.stored, c.ids, c.parent) for c in changes] == [
        (GPU, True, (1, 2, 3), None),
        (CPU, True, (1, 2, 3), None),
    ]
    again, changes = engine.serve((1, 2, 3), 12, now=10.0)
    assert (again.gpu_tokens, again.cpu_tokens, again.computed_tokens) == (11, 0, 1)
    assert changes == []  # nothing new on either tier
    assert again.started == 10.0 and again.ttft == pytest.approx(TimeModel().prefill_s(1, 0))


def test_blocks_the_gpu_lets_go_are_hit_on_the_cpu_and_loaded_back() -> None:
    engine = _engine(4, 16)
    engine.serve((1, 2, 3), 12, now=0.0)
    _, changes = engine.serve((7, 8, 9), 12, now=1.0)
    # The GPU keeps 4: the older chain goes tail first (3, then 2).
    assert [(c.medium, c.stored, c.ids) for c in changes if not c.stored] == [(GPU, False, (3, 2))]
    served, changes = engine.serve((1, 2, 3, 4), 17, now=2.0)
    assert (served.gpu_tokens, served.cpu_tokens, served.computed_tokens) == (4, 8, 5)
    stored = [(c.medium, c.ids, c.parent) for c in changes if c.stored]
    assert stored == [(GPU, (2, 3, 4), 1), (CPU, (4,), 3)]
    model = TimeModel()
    assert served.ttft == pytest.approx(model.prefill_s(5, 2))


def test_a_queue_delays_the_next_prefill() -> None:
    engine = _engine(64, 64)
    a, _ = engine.serve((1, 2), 8, now=0.0)
    b, _ = engine.serve((5, 6), 8, now=0.0)
    assert b.started == a.first_token and b.ttft == pytest.approx(2 * a.ttft)


def test_what_the_fleets_release_is_what_their_engines_hold(tmp_path: Path) -> None:
    """Every change each engine made, released in time order to a sink, leaves the sink
    holding exactly the engines' tiers (the events say the caches)."""
    path = conversation_trace(tmp_path / "t.jsonl", conversations=40)
    shape = FleetShape(engines=3, gpu_blocks=6, cpu_blocks=20, block_tokens=512)
    fleet = Fleet(shape)
    known = KnownState(3)
    fleet.sinks.append(known)
    for i, request in enumerate(read_trace(path)):
        now = request.at_ms / 1000
        fleet.release(now)
        fleet.dispatch(i % 3, request.full_blocks(512), request.input_length, now)
    fleet.release(float("inf"))
    for e, engine in enumerate(fleet.engines):
        assert known.held[e][GPU] == set(engine.gpu.blocks) != set()
        assert engine.cpu is not None
        assert known.held[e][CPU] == set(engine.cpu.blocks)
        assert len(engine.gpu) <= 6 and len(engine.cpu) <= 20


@pytest.mark.parametrize(("engines", "gap_ms"), [(2, 150), (5, 1000)])
def test_no_policy_beats_the_pool_or_the_best_engine_for_each_request(
    tmp_path: Path, engines: int, gap_ms: int
) -> None:
    """The pool is one LRU cache of the fleet's capacity: no routing over the same capacity
    in parts serves much more from cache (an LRU pool is no strict bound: a part seldom used
    can keep a block the pool let go, so a tenth of a point is allowed). And no request is
    answered sooner, or served more from cache, than the best engine of its fleet offered
    when it came; the oracle takes the soonest every time."""
    path = conversation_trace(tmp_path / "t.jsonl", conversations=80, gap_ms=gap_ms)
    config = ReplayConfig(
        path, engines=engines, tokens_per_engine=24 * 512, gpu_share=0.25, speed=1e9,
        policies=OFFLINE,
    )  # fmt: skip
    tallies = replay(config).tallies
    pool = tallies["global_pool"]
    for name, tally in tallies.items():
        assert tally.requests == 320
        assert tally.hit_rate <= pool.hit_rate + 0.001, name
        assert tally.worst_regret_s >= -1e-9 and tally.missed_tokens >= 0, name
    assert tallies["oracle"].regret_s == pytest.approx(0, abs=1e-6)
    assert tallies["round_robin"].regret_s > 0 and tallies["round_robin"].missed_tokens > 0
    assert tallies["round_robin"].hit_rate < tallies["oracle"].hit_rate  # the bounds bite


def test_the_kvledger_policies_need_kafka(tmp_path: Path) -> None:
    path = conversation_trace(tmp_path / "t.jsonl", conversations=2)
    with pytest.raises(ValueError, match="need Kafka"):
        replay(ReplayConfig(path, policies=("kvledger_tiered",)))
