"""Scripted vLLM engines for the Dynamo tests: vLLM 0.33.0's own ``ZmqEventPublisher``
(from its wheel), each holding prefixes of a few fixed token chains, the truth of what each
holds, the relay that hears one, and Dynamo 1.6.1's standalone indexer as a process."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from kvledger.consumer.db import connect
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.relay import Relay
from kvledger.serving.republish.publisher import Endpoint, Publisher
from kvledger.serving.router.index import RouterIndex
from tests.helpers.procs import free_port, spawn

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


def relay(engine: Engine, bootstrap: str, topic: str) -> Relay:
    r = Relay(RelayConfig(
        endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint,
        source=f"engine-{engine.index}", model=MODEL, bootstrap_servers=bootstrap, topic=topic,
        groups=[parse_group(f"0:full_attention:{BLOCK}", MODEL)], heartbeat_interval_s=1.0,
    ))  # fmt: skip
    r.start()
    assert r.ready(60), "the relay did not resynchronise with its engine"
    return r


def wait_until(what: str, ok: Callable[[], bool], timeout: float = 60) -> float:
    """Seconds until ``ok()`` held (polled every 0.1 s)."""
    start = time.monotonic()
    while not ok():
        assert time.monotonic() - start < timeout, f"never: {what}"
        time.sleep(0.1)
    return time.monotonic() - start


@dataclass
class RepublishedFleet:
    """Three engines (the third with a replay buffer of 4 batches), a relay each into the
    topic, a router index following it, and `kvledger republish`'s sockets per engine."""

    engines: list[Engine]
    relays: list[Relay]
    index: RouterIndex
    endpoints: list[Endpoint]
    publisher: Publisher

    def stop(self) -> None:
        self.publisher.stop()
        self.index.stop()
        for r in self.relays:
            r.stop()
        for e in self.engines:
            e.publisher.shutdown()


def republished_fleet(
    kv: ModuleType, bootstrap: str, database: str, topic: str, group_id: str,
    silent_after_s: float,
) -> RepublishedFleet:  # fmt: skip
    engines = [Engine(kv, 0), Engine(kv, 1), Engine(kv, 2, buffer_steps=4)]
    relays = [relay(e, bootstrap, topic) for e in engines]
    index = RouterIndex(bootstrap, topic, group_id)
    with connect(database) as conn:
        index.bootstrap(conn)
    index.start()
    endpoints = [
        Endpoint(f"engine-{e.index}", f"tcp://127.0.0.1:{free_port()}",
                 f"tcp://127.0.0.1:{free_port()}")
        for e in engines
    ]  # fmt: skip
    publisher = Publisher(index, endpoints, silent_after_s=silent_after_s)
    publisher.start()
    return RepublishedFleet(engines, relays, index, endpoints, publisher)


def lose_removals(
    engines: list[Engine], relays: list[Relay], i: int, bootstrap: str, topic: str,
    settle: Any,
) -> None:  # fmt: skip
    """Engine ``i`` holds every chain whole; its relay goes down while it evicts them all
    and stores four chains to 3 blocks (more batches than a buffer of 4 holds), then comes
    back: kvledger records the loss, clears the engine, and holds what was replayed.
    ``settle(engine)`` waits until the listener under test shows the engine's latest."""
    e = engines[i]
    for c in range(CHAINS):
        e.store(c, LENGTH)
    settle(e)
    relays[i].stop()
    for c in range(CHAINS):
        e.evict(c, 0)
    for c in range(4):
        e.store(c, 3)
    relays[i] = relay(e, bootstrap, topic)
    settle(e)


def start_dynamo_indexer(
    log_dir: Path, name: str = "dynamo", port: int | None = None
) -> tuple[str, subprocess.Popen[Any]]:
    """Dynamo's standalone indexer (``python -m dynamo.indexer``) on a port of its own (or
    ``port``), answering; its URL and process."""
    port = port or free_port()
    log = open(log_dir / f"{name}.log", "a")  # noqa: SIM115 - the child writes it
    proc = spawn(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--block-size",
         str(BLOCK), "--model-name", MODEL],
        stdout=log, stderr=log, env={**os.environ, "DYN_KV_INDEXER_TEST_ENDPOINTS": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/health")
            return url, proc
        except httpx.TransportError:
            assert time.monotonic() < deadline, "Dynamo's indexer never answered"
            time.sleep(0.3)
