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

import random
import time
from collections import Counter
from datetime import timedelta

import httpx
import pytest
from starlette.testclient import TestClient

from kvledger.consumer.db import connect
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.router.index import RouterIndex
from tests.helpers.procs import require_dynamo
from tests.helpers.scripted_engines import (
    BLOCK,
    CHAINS,
    LENGTH,
    MODEL,
    TOKENS,
    Engine,
    prompts,
    relay,
    start_dynamo_indexer,
    truth,
)

pytestmark = pytest.mark.integration
require_dynamo()


def test_kvledger_stays_exact_where_dynamos_indexer_does_not(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events, tmp_path
) -> None:
    kv = vllm_kv_events
    topic = make_topic("dynamo-faults", partitions=3)
    engines = [Engine(kv, 0), Engine(kv, 1), Engine(kv, 2, buffer_steps=4)]
    dynamo, _ = start_dynamo_indexer(tmp_path)
    for e in engines:
        reg = {"instance_id": e.index, "endpoint": e.endpoint, "replay_endpoint":
               e.replay_endpoint, "model_name": MODEL, "block_size": BLOCK}  # fmt: skip
        assert httpx.post(f"{dynamo}/register", json=reg).status_code == 201
    relays = [relay(e, kafka_bootstrap, topic) for e in engines]
    router = RouterIndex(kafka_bootstrap, topic, group_id, dynamo=True)
    with connect(fresh_database) as conn:
        router.bootstrap(conn)
    router.start()
    ours = TestClient(
        create_app(ServiceConfig(router=router, silent_after=timedelta(hours=1), dynamo_api=True))
    )
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
