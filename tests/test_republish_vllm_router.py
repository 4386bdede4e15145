"""`kvledger republish` heard by vllm-router 0.1.17's ``kv_aware`` policy (its released
binary, the lab's install), beside the same router fed by the engines directly.

Three vLLM publishers (vLLM 0.33.0's ``ZmqEventPublisher`` from its wheel) feed `kvledger
relay`s into real Kafka; a router index follows the topic and republishes each engine on
vLLM's sockets. Two vllm-routers route over the same three workers (HTTP stand-ins:
tests/helpers/stand_in_workers.py, which record where each prompt was sent): one hears the
engines' own streams, one hears kvledger's. A prompt some engine holds more of than any
other must go to that engine. Through the faults:

- steady state: both routers route every such prompt to its holder;
- an engine restarts (a crash: sequence back to 0, an empty cache, no goodbye);
- kvledger's relay of an engine is down while that engine's removals fall past its buffer;
- both routers restart (the engines say nothing meanwhile), where one engine's holdings are
  older than its replay buffer;
- an engine dies for good (its stream, its relay and its HTTP port).

The router fed by kvledger routes as the truth says after each (within seconds); the one
fed directly is recorded as it is (printed, and stated in docs/routers.md).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.procs import free_port, spawn
from tests.helpers.scripted_engines import (
    BLOCK,
    CHAINS,
    LENGTH,
    MODEL,
    TOKENS,
    Engine,
    lose_removals,
    republished_fleet,
    wait_until,
)
from tests.helpers.stand_in_workers import Worker, prompt_text

pytestmark = [pytest.mark.integration, pytest.mark.downloads]

SILENT_S = 4.0  # the liveness window (the relays heartbeat every second)


class KvAware:
    """vllm-router's kv_aware policy over ``workers``, hearing ``sources[i]`` = (PUB,
    replay) for worker i."""

    def __init__(
        self, name: str, workers: list[Worker], sources: list[tuple[str, str]], logs: Path
    ) -> None:
        from bench.lab.install import engine_env

        self.name, self.workers, self.logs = name, workers, logs
        self.port = free_port()
        self.args = [
            str(engine_env() / "bin" / "vllm-router"), "--host", "127.0.0.1",
            "--port", str(self.port), "--policy", "kv_aware",
            "--worker-urls", *(w.url for w in workers),
            "--prometheus-port", str(free_port()), "--log-level", "warning",
            "--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL,
        ]  # fmt: skip
        for w, (pub, replay) in zip(workers, sources, strict=True):
            self.args += ["--kv-event-source", f"{w.url}={pub}",
                          "--kv-event-replay-source", f"{w.url}={replay}"]  # fmt: skip
        self.proc: Any = None

    def start(self) -> None:
        log = open(self.logs / f"{self.name}.log", "a")  # noqa: SIM115 - the child writes it
        self.proc = spawn(self.args, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, (self.logs / f"{self.name}.log").read_text()
            assert time.monotonic() < deadline, f"{self.name} never answered"
            time.sleep(0.3)

    def restart(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.start()

    def route(self, tokens: list[int]) -> int | None:
        """The worker the router sent ``tokens`` to (None: the request failed)."""
        before = [len(w.completions) for w in self.workers]
        body = {"model": MODEL, "prompt": prompt_text(tokens), "max_tokens": 1}
        try:
            r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=30)
        except httpx.TransportError:
            return None
        if r.status_code != 200:
            return None
        got = [i for i, (w, n) in enumerate(zip(self.workers, before, strict=True))
               if len(w.completions) > n]  # fmt: skip
        assert len(got) == 1, got
        return got[0]


def best_holder(engines: list[Engine], chain: int, blocks: int) -> int | None:
    """The engine holding strictly more of the prompt than any other (None: a tie or no
    one)."""
    scores = sorted(((e.score(chain, blocks), e.index) for e in engines), reverse=True)
    if scores[0][0] == 0 or scores[0][0] == scores[1][0]:
        return None
    return scores[0][1]


def judged(engines: list[Engine]) -> list[tuple[int, int, int]]:
    """(chain, blocks, best holder) of each prompt one engine holds more of than any
    other: every chain cut at 2, 5 and 8 blocks."""
    return [
        (c, m, want)
        for c in range(CHAINS)
        for m in (2, 5, LENGTH)
        if (want := best_holder(engines, c, m)) is not None
    ]


def misrouted(router: KvAware, engines: list[Engine]) -> list[tuple[int, int, int | None]]:
    """(chain, blocks, where it went) of each judged prompt routed elsewhere (None: the
    request failed)."""
    out = []
    for c, m, want in judged(engines):
        got = router.route([*TOKENS[c][: m * BLOCK], 7, 7, 7])
        if got != want:
            out.append((c, m, got))
    return out


def test_vllm_router_fed_by_kvledger_routes_as_the_truth(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events, tmp_path
) -> None:
    topic = make_topic("republish-vllm-router", partitions=3)
    fleet = republished_fleet(vllm_kv_events, kafka_bootstrap, fresh_database, topic,
                              group_id, SILENT_S)  # fmt: skip
    engines, relays, endpoints = fleet.engines, fleet.relays, fleet.endpoints
    workers = [Worker(MODEL) for _ in engines]
    direct = KvAware("direct", workers, [(e.endpoint, e.replay_endpoint) for e in engines],
                     tmp_path)  # fmt: skip
    ours = KvAware("via-kvledger", workers, [(p.pub, str(p.replay)) for p in endpoints],
                   tmp_path)  # fmt: skip
    direct.start()
    ours.start()
    sentinels = iter(range(CHAINS, len(TOKENS)))
    record: dict[str, str] = {}  # phase -> prompts the direct router misroutes, of judged

    def settle(*moved: Engine) -> None:
        """Each engine named stores a chain of its own; wait until the router fed by
        kvledger sends it there, then give the direct one as long again (at least 2 s)."""
        for e in moved:
            c = next(sentinels)
            e.store(c, 1)
            tokens = [*TOKENS[c][:BLOCK], 7]
            took = wait_until(f"kvledger's router sends engine {e.index}'s sentinel there",
                              lambda t=tokens, e=e: ours.route(t) == e.index, 60)  # fmt: skip
            deadline = time.monotonic() + max(took, 2.0)
            while direct.route(tokens) != e.index and time.monotonic() < deadline:
                time.sleep(0.2)

    def check(phase: str) -> None:
        """The router fed by kvledger routes as the truth says (given a few seconds to
        apply what it heard); the direct one is recorded."""
        try:
            wait_until(phase, lambda: misrouted(ours, engines) == [], timeout=15)
        except AssertionError:
            raise AssertionError(
                f"{phase}: the router fed by kvledger misroutes {misrouted(ours, engines)}"
            ) from None
        theirs = misrouted(direct, engines)
        record[phase] = f"{len(theirs)} of {len(judged(engines))}"
        print(f"{phase}: fed directly misroutes {record[phase]}: {theirs}")

    work = random.Random(7)
    try:
        # Each engine holds a different, skewed set of chains: most prompts have one best.
        engines[0].work(work, 40, range(CHAINS))
        engines[1].work(work, 40, range(3, CHAINS))
        engines[2].work(work, 40, range(CHAINS))
        for c in range(3, CHAINS):
            engines[1].store(c, LENGTH)
        settle(*engines)
        check("steady state")
        assert record["steady state"].startswith("0 of")  # the method: the direct one too

        # Engine 1 crashes and comes back on the same ports, then serves chains 0-2 only.
        engines[1].restart()
        engines[1].work(work, 20, range(3))
        settle(engines[1])
        check("after an engine restart")

        # kvledger's relay of engine 2 is down while its removals fall past its buffer.
        lose_removals(engines, relays, 2, kafka_bootstrap, topic, settle)
        check("after kvledger's relay lost a gap")

        # Engine 2 moves on (its last stores now older than its 4-batch buffer); both
        # routers restart, and no engine publishes while they come back.
        for c in range(CHAINS, CHAINS + 5):
            engines[2].store(c, 1)
        settle(engines[2])
        direct.restart()
        ours.restart()
        took = wait_until("kvledger's router routes as the truth after its restart",
                          lambda: misrouted(ours, engines) == [], 30)  # fmt: skip
        print(f"the router restarted: fed by kvledger, exact {took:.1f} s after it answered")
        check("after the routers' restart")

        # Engine 0 dies for good: its stream, its relay, its HTTP port.
        engines[0].publisher.shutdown()
        relays[0].stop()
        workers[0].close()
        engines[0].held = [0] * len(TOKENS)
        took = wait_until("kvledger's router stops naming the dead engine",
                          lambda: misrouted(ours, engines) == [], SILENT_S + 30)  # fmt: skip
        print(f"a dead engine: fed by kvledger, routed around {took:.1f} s after it died")
        check("after an engine died")
        print("misrouted when fed directly (fed by kvledger: none):", record)
    finally:
        for r in (direct, ours):
            if r.proc is not None:
                r.proc.kill()
        fleet.stop()
        for w in workers[1:]:
            w.close()
