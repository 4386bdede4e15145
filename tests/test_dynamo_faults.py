"""kvledger and Dynamo's own indexer fed the same engines: three vLLM publishers (vLLM
0.33.0's ``ZmqEventPublisher`` from its wheel), each heard by a `kvledger relay` (into
real Kafka, then a router index serving Dynamo's API) and by Dynamo's standalone indexer
(``python -m dynamo.indexer``, ai-dynamo-runtime 1.6.1, dialling the engines itself after
``/register``). Both are asked Dynamo's ``POST /query`` and held to the truth: what each
engine holds after what it published.

- steady state: both are exact;
- an engine restarts (vLLM's sequence back to 0, an empty cache, no goodbye): kvledger is
  exact, Dynamo still claims what the engine held before;
- an engine's removals fall past its replay buffer while both were not listening: kvledger
  records the loss, clears the engine and is exact again from what it replays; Dynamo
  still claims the removed blocks.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from kvledger.consumer.db import connect
from kvledger.consumer.lookup.http import create_app
from kvledger.consumer.router.index import RouterIndex
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.relay import Relay
from tests.helpers.procs import free_port, spawn
from tests.helpers.vllm_wheel import vllm_module

pytestmark = pytest.mark.integration
if os.environ.get("CI") != "true":
    pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the dev extra)")

MODEL, BLOCK, CHAINS, LENGTH = "m", 4, 6, 8
rng = random.Random(31)
TOKENS = [[rng.randrange(1, 50_000) for _ in range(BLOCK * LENGTH)] for _ in range(CHAINS + 9)]


def block_hash(chain: int, j: int) -> int:
    """Block j of a chain, as an engine hashes it: from its tokens and all before them."""
    prefix = repr(TOKENS[chain][: (j + 1) * BLOCK]).encode()
    return int.from_bytes(hashlib.sha256(prefix).digest()[:8], "big") >> 1


class Engine:
    """One vLLM publisher and what it holds on GPU: a prefix of each chain."""

    def __init__(self, kv: ModuleType, index: int, buffer_steps: int = 10_000) -> None:
        self.kv, self.index, self.buffer_steps = kv, index, buffer_steps
        self.port, self.replay = free_port(), free_port()
        self.held = [0] * len(TOKENS)
        self.publisher = self._publisher()

    def _publisher(self) -> Any:
        return self.kv.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=f"tcp://*:{self.port}",
            replay_endpoint=f"tcp://*:{self.replay}", buffer_steps=self.buffer_steps,
        )  # fmt: skip

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay}"

    def store(self, chain: int, upto: int) -> None:
        have = self.held[chain]
        if upto <= have:
            return
        self._send(self.kv.BlockStored(
            block_hashes=[block_hash(chain, j) for j in range(have, upto)],
            parent_block_hash=block_hash(chain, have - 1) if have else None,
            token_ids=TOKENS[chain][have * BLOCK : upto * BLOCK], block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None,
        ))  # fmt: skip
        self.held[chain] = upto

    def evict(self, chain: int, downto: int) -> None:
        have = self.held[chain]
        if downto >= have:
            return
        hashes = [block_hash(chain, j) for j in reversed(range(downto, have))]
        self._send(self.kv.BlockRemoved(block_hashes=hashes, medium="GPU"))
        self.held[chain] = downto

    def _send(self, event: Any) -> None:
        self.publisher.publish(self.kv.KVEventBatch(ts=time.time(), events=[event]))

    def work(self, r: random.Random, batches: int, chains: range) -> None:
        for _ in range(batches):
            c = r.choice(chains)
            if r.random() < 0.7:
                self.store(c, r.randint(self.held[c] + 1, LENGTH) if self.held[c] < LENGTH else 0)
            else:
                self.evict(c, r.randint(0, self.held[c]))

    def restart(self) -> None:
        """A crash and a new engine on the same ports: sequence 0, nothing cached."""
        self.publisher.shutdown()
        time.sleep(0.5)
        self.publisher = self._publisher()
        self.held = [0] * len(TOKENS)

    def score(self, chain: int, blocks: int) -> int:
        return min(self.held[chain], blocks)


def prompts() -> list[tuple[int, int, list[int]]]:
    """(chain, full blocks of it, tokens): every chain cut at 2, 5 and 8 blocks, a tail."""
    return [
        (c, m, [*TOKENS[c][: m * BLOCK], 7, 7, 7])
        for c in range(CHAINS)  # not the sentinels (see settle)
        for m in (2, 5, LENGTH)
    ]  # fmt: skip


def truth(engines: list[Engine], chain: int, blocks: int) -> dict[str, dict[str, int]]:
    out = {}
    for e in engines:
        if (n := e.score(chain, blocks)) > 0:
            out[str(e.index)] = {"0": n * BLOCK}
    return out


@pytest.fixture
def vllm_kv_events() -> Iterator[ModuleType]:
    with vllm_module("vllm.distributed.kv_events") as module:
        yield module


def relay(engine: Engine, bootstrap: str, topic: str) -> Relay:
    r = Relay(RelayConfig(
        endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint,
        source=f"engine-{engine.index}", model=MODEL, bootstrap_servers=bootstrap, topic=topic,
        groups=[parse_group(f"0:full_attention:{BLOCK}", MODEL)], heartbeat_interval_s=1.0,
    ))  # fmt: skip
    r.start()
    assert r.ready(60), "the relay did not resynchronise with its engine"
    return r


def test_kvledger_stays_exact_where_dynamos_indexer_does_not(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events, tmp_path
) -> None:
    kv = vllm_kv_events
    topic = make_topic("dynamo-faults", partitions=3)
    engines = [Engine(kv, 0), Engine(kv, 1), Engine(kv, 2, buffer_steps=4)]
    dport = free_port()
    dynamo = f"http://127.0.0.1:{dport}"
    log = open(tmp_path / "dynamo.log", "w")  # noqa: SIM115 - the child writes it
    spawn(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(dport), "--block-size",
         str(BLOCK), "--model-name", MODEL],
        stdout=log, stderr=log, env={**os.environ, "DYN_KV_INDEXER_TEST_ENDPOINTS": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{dynamo}/health")
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "Dynamo's indexer never answered"
            time.sleep(0.3)
    for e in engines:
        reg = {"instance_id": e.index, "endpoint": e.endpoint, "replay_endpoint":
               e.replay_endpoint, "model_name": MODEL, "block_size": BLOCK}  # fmt: skip
        assert httpx.post(f"{dynamo}/register", json=reg).status_code == 201
    relays = [relay(e, kafka_bootstrap, topic) for e in engines]
    router = RouterIndex(kafka_bootstrap, topic, group_id, dynamo=True)
    with connect(fresh_database) as conn:
        router.bootstrap(conn)
    router.start()
    ours = TestClient(create_app(router=router, silent_after=timedelta(hours=1), dynamo_api=True))
    sentinels = iter(range(CHAINS, len(TOKENS)))

    def settle(*moved: Engine, theirs: bool = True) -> None:
        """Each engine named stores a chain of its own; wait until both indexes show it
        (``theirs=False``: only kvledger, then a while for Dynamo)."""
        for e in moved:
            c = next(sentinels)
            e.store(c, 1)
            body = {"token_ids": TOKENS[c][:BLOCK], "model_name": MODEL}
            start = time.monotonic()
            nudged = False
            while True:
                a = ours.post("/query", json=body)
                b = httpx.post(f"{dynamo}/query", json=body)
                seen = [str(e.index) in r.json().get("scores", {}) for r in (a, b)]
                if seen[0] and (seen[1] or not theirs):
                    break
                if theirs and not nudged and time.monotonic() - start > 5:
                    e.store(c, 2)  # a later batch: a listener that missed one asks replay
                    nudged = True
                assert time.monotonic() - start < 60, (a.text, b.text)
                time.sleep(0.1)
            if not theirs:
                time.sleep(2)

    def answers() -> tuple[int, int, Counter[str], Counter[str]]:
        """(prompts kvledger got wrong, prompts Dynamo got wrong, per worker the prompts
        kvledger over-claimed it on, the same of Dynamo)."""
        wrong_ours = wrong_theirs = 0
        over_ours: Counter[str] = Counter()
        over_theirs: Counter[str] = Counter()
        for c, m, tokens in prompts():
            body = {"token_ids": tokens, "model_name": MODEL}
            want = truth(engines, c, m)
            a = ours.post("/query", json=body).json()["scores"]
            b = httpx.post(f"{dynamo}/query", json=body).json()["scores"]
            wrong_ours += a != want
            wrong_theirs += b != want
            for got, over in ((a, over_ours), (b, over_theirs)):
                over.update(w for w in got if got[w]["0"] > want.get(w, {"0": 0})["0"])
        return wrong_ours, wrong_theirs, over_ours, over_theirs

    work = random.Random(5)
    try:
        engines[0].work(work, 60, range(CHAINS))
        engines[1].work(work, 60, range(3, CHAINS))  # chains 3-5: what a restart loses
        engines[2].work(work, 60, range(CHAINS))
        for c in range(3, CHAINS):
            engines[1].store(c, LENGTH)
        settle(*engines)
        assert answers()[:2] == (0, 0)  # steady state: both exact, on all prompts

        # An engine restarts (no goodbye: a crash), then serves chains 0-2 only.
        engines[1].restart()
        engines[1].work(work, 30, range(3))
        settle(engines[1], theirs=False)  # Dynamo takes sequence 0 again as old news
        wrong_ours, wrong_theirs, over_ours, over_theirs = answers()
        print(f"after a restart, prompts wrong: kvledger {wrong_ours}, Dynamo {wrong_theirs}")
        assert (wrong_ours, sum(over_ours.values())) == (0, 0)
        assert wrong_theirs > 0 and over_theirs["1"] > 0  # Dynamo: the old engine's chains

        # Engine 2's removals fall past its replay buffer while neither listens.
        for c in range(CHAINS):
            engines[2].store(c, LENGTH)
        settle(engines[2])
        relays[2].stop()
        pause = {"instance_id": 2}
        assert httpx.post(f"{dynamo}/test/pause_listener", json=pause).status_code == 200
        for c in range(CHAINS):
            engines[2].evict(c, 0)  # 6 batches of removals, then 4 stores: the buffer holds 4
        for c in range(4):
            engines[2].store(c, 3)
        relays[2] = relay(engines[2], kafka_bootstrap, topic)
        assert httpx.post(f"{dynamo}/test/resume_listener", json=pause).status_code == 200
        time.sleep(1)  # its new SUB socket joins the engine's PUB (slow joiner)
        settle(engines[2])
        wrong_ours, wrong_theirs, over_ours, over_theirs = answers()
        # kvledger recorded the loss and cleared engine 2, then applied what was replayed:
        # exact; Dynamo never saw the removals.
        print(f"after a lost gap, prompts wrong: kvledger {wrong_ours}, Dynamo {wrong_theirs}")
        assert (wrong_ours, sum(over_ours.values())) == (0, 0)
        assert wrong_theirs > 0 and over_theirs["2"] > 0
    finally:
        router.stop()
        for r in relays:
            r.stop()
        for e in engines:
            e.publisher.shutdown()
