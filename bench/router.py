"""The router index beside the SQL index, in the same run, on the lookup benchmark's index
(1,024,000 blocks, 64 instances, 128-hash prompts with mixed hit depths).

Figures: bootstrap time and memory (RSS growth, per block and per residency), in-process
lookup p50/p99 and lookups/s on one thread beside SQL's on the same prompts, HTTP p50/p99
from a `kvledger serve --memory` process and from two replicas side by side, and the tail's
apply rate (pre-encoded fleet
messages through the pipeline into the router's store) beside decoding alone.
"""

from __future__ import annotations

import gc
import os
import random
import time
import uuid
from array import array
from datetime import timedelta

from confluent_kafka.admin import AdminClient

from bench import lookup
from bench.common import (
    client_times,
    lookup_service,
    lookup_services,
    percentiles_ms,
    post_times,
    record,
    settle,
)
from bench.consume import _messages
from kvledger.consumer.core.model import GroupKey
from kvledger.consumer.db import connect
from kvledger.consumer.inbound import Inbound, decode
from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.schemas.topics import ensure_topic
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.router.index import APPLY_CHUNK, RouterIndex, collector_paused
from kvledger.serving.router.store import RouterStore
from tests.helpers.pure_router.group import PureGroup

WIDE = timedelta(days=1)  # the generated instances publish nothing


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _timed(fn: object, prompts: list[list[bytes]]) -> tuple[float, float, float]:
    times = []
    start = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        fn(p)  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    p50, p99 = percentiles_ms(times)
    return p50 * 1000, p99 * 1000, len(prompts) / total  # µs, µs, lookups/s


def _pure_group(router: RouterIndex, fn: object, prompts: list[list[bytes]]) -> dict[str, float]:
    """The same lookups with the pure-Python group (the baseline of the compiled one)."""
    key = GroupKey("bench", 0)
    compiled = router.store.groups[key]
    pure = PureGroup()
    for h in compiled.hashes():
        fields = compiled.row(h)
        meta = compiled.meta(h)
        assert fields is not None and meta is not None
        pure.add_row(h, *fields, *meta)
    for h, hid, count in compiled.residencies():
        pure.hold(h, hid, count)
    router.store.groups[key] = pure
    gc.collect()
    try:
        _timed(fn, prompts[:200])
        p50, p99, rate = _timed(fn, prompts)
    finally:
        router.store.groups[key] = compiled
    return {
        "memory, pure-Python group: p50 us": p50,
        "memory, pure-Python group: p99 us": p99,
        "memory, pure-Python group: lookups/s": rate,
    }


def tail_rate(rounds: int = 3) -> dict[str, float]:
    """The router's apply path (:meth:`RouterIndex.apply`: chunks under the lookups' lock,
    the cycle collector paused per chunk, stores and removals in one native call each:
    serving/router/lane.py) beside the same chunks, collector paused too, with every
    message through the planner (the path before the lane), alternating, best round of
    each."""
    messages = [
        Inbound("bench", 0, i, k, v)
        for i, (k, v) in enumerate(_messages(FleetConfig(instances=4, requests=500, seed=21)))
    ]
    codec = Codec()
    gc.collect()
    start = time.perf_counter()
    for m in messages:
        decode(m, codec)
    decode_s = time.perf_counter() - start

    def router_path() -> tuple[int, float]:
        router = RouterIndex("localhost:1", "bench", "bench", codec=codec)  # never connects
        start = time.perf_counter()
        router.apply(messages)
        return router.block_events, time.perf_counter() - start

    def planner_path() -> tuple[int, float]:
        store, events = RouterStore(), 0
        start = time.perf_counter()
        for i in range(0, len(messages), APPLY_CHUNK):
            with collector_paused():
                plan = run_batch(messages[i : i + APPLY_CHUNK], codec, store, "bench").plan
            events += plan.block_events
        return events, time.perf_counter() - start

    best = {"now": 0.0, "planner": 0.0}
    events = 0
    for _ in range(rounds):
        for name, run in (("now", router_path), ("planner", planner_path)):
            gc.collect()
            events, seconds = run()
            best[name] = max(best[name], events / seconds)
    return {
        "tail block events": float(events),
        "tail apply block-events/s (decode+plan+store)": best["now"],
        "  same chunks, every message through the planner (before)": best["planner"],
        "  ratio now/before": best["now"] / best["planner"],
        "decode alone, block-events/s": events / decode_s,
    }


def main(lookups: int = 2000) -> dict[str, float]:
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    url = lookup._database(os.environ["KVLEDGER_DATABASE_URL"])
    blocks = lookup.populate(url)
    settle(url)
    topic = f"bench-router-{uuid.uuid4().hex[:8]}"  # nothing to tail: the index is generated
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    ensure_topic(admin, topic, 3)
    figures: dict[str, float] = {"blocks": float(blocks)}
    gc.collect()
    before = _rss()
    router = RouterIndex(bootstrap, topic, "bench-router")
    start = time.perf_counter()
    with connect(url) as conn:
        router.bootstrap(conn)
        (residencies,) = conn.execute("SELECT count(*) FROM kvledger.residencies").fetchone() or (
            0,
        )
    figures["bootstrap s"] = time.perf_counter() - start
    gc.collect()
    grown = _rss() - before
    figures["memory MB (RSS growth)"] = grown / 2**20
    figures["bytes per block"] = grown / blocks
    figures["bytes per residency"] = grown / residencies
    rng = random.Random(1)
    prompts = [lookup._prompt(rng) for _ in range(lookups)]
    gc.freeze()
    in_memory = lambda p: router.match("bench", 0, p, "block", False, WIDE)  # noqa: E731
    _timed(in_memory, prompts[:200])
    p50, p99, rate = _timed(in_memory, prompts)
    figures |= {"memory p50 us": p50, "memory p99 us": p99, "memory lookups/s": rate}
    # The same chains asked by their tokens (what Dynamo's and llm-d's routers send): block
    # i of chain c holds 16 tokens c, so a prompt of chain c is its id 2,048 times.
    rng = random.Random(1)
    chains = [int(lookup._prompt_chain(rng)) for _ in range(lookups)]
    token_prompts = [[c] * (lookup.LENGTH * 16) for c in chains]
    by_tokens = lambda t: router.match_tokens("bench", 0, t, None, False, WIDE)  # noqa: E731
    _timed(by_tokens, token_prompts[:200])
    p50, p99, rate = _timed(by_tokens, token_prompts)
    figures |= {
        "memory, by tokens: p50 us": p50,
        "memory, by tokens: p99 us": p99,
        "memory, by tokens: lookups/s": rate,
        "memory, by tokens: p50 / by hashes p50": p50 / figures["memory p50 us"],
    }
    # The same prompts packed as int32 arrays (a tokenizer's array output): no id is read
    # as a Python int.
    packed = [array("i", t) for t in token_prompts]
    _timed(by_tokens, packed[:200])
    p50, p99, _ = _timed(by_tokens, packed)
    figures |= {
        "memory, by tokens in an int32 array: p50 us": p50,
        "memory, by tokens in an int32 array: p99 us": p99,
        "memory, by tokens in an int32 array: p50 / by hashes p50": p50 / figures["memory p50 us"],
    }
    figures["same answers by tokens and by hashes (200 prompts)"] = float(
        all(
            in_memory(p) == by_tokens(t) == by_tokens(a)
            for p, t, a in zip(prompts[:200], token_prompts, packed, strict=False)
        )
    )
    figures |= _pure_group(router, in_memory, prompts)
    figures |= {
        k.replace("group:", "group, by tokens:"): v
        for k, v in _pure_group(router, by_tokens, token_prompts).items()
    }
    with connect(url, autocommit=True) as conn:
        index = PrefixIndex(conn)
        sql = lambda p: index.match("bench", 0, p)  # noqa: E731
        _timed(sql, prompts[:200])
        p50, p99, rate = _timed(sql, prompts)
        same = all(index.match("bench", 0, p) == router.match("bench", 0, p, silent_after=WIDE)
                   for p in prompts[:200])  # fmt: skip
    figures |= {"SQL p50 us": p50, "SQL p99 us": p99, "SQL lookups/s": rate}
    figures["same answers (200 prompts)"] = float(same)
    figures |= _http(url, bootstrap, topic, prompts)
    figures |= tail_rate()
    gc.unfreeze()
    admin.delete_topics([topic])
    record("router", figures)
    return figures


def _http(url: str, bootstrap: str, topic: str, prompts: list[list[bytes]]) -> dict[str, float]:
    """One `kvledger serve --memory` process, then two replicas side by side (each an
    independent reader of the log, bootstrapped at the same time, each asked by its own
    client at the same time)."""
    import threading

    def args(group: str) -> list[str]:
        return ["--memory", "--database-url", url, "--bootstrap", bootstrap, "--topic", topic,
                "--consumer-group", group, "--silent-after", "86400"]  # fmt: skip

    bodies = [{"model": "bench", "hashes": [h.hex() for h in p]} for p in prompts]
    figures: dict[str, float] = {}
    start = time.perf_counter()
    with lookup_service(args("bench-router"), start_timeout_s=300) as base:  # bootstraps first
        figures["one replica: up in s"] = time.perf_counter() - start
        times = client_times(base, prompts)
        figures["one replica: HTTP lookups/s (one client)"] = len(times) / sum(times)
        p50, p99 = percentiles_ms(times)
        figures |= {"HTTP from memory p50 ms": p50, "HTTP from memory p99 ms": p99}
        # The same requests from httpx (the client the earlier figures were taken with; it
        # adds ~0.2 ms of its own per request).
        p50, p99 = percentiles_ms(post_times(base, bodies))
        figures |= {
            "HTTP from memory, httpx client: p50 ms": p50,
            "HTTP from memory, httpx client: p99 ms": p99,
        }
    start = time.perf_counter()
    with lookup_services([args("bench-router")] * 2, start_timeout_s=300) as bases:
        figures["two replicas (started together): both up in s"] = time.perf_counter() - start
        results: list[list[float]] = [[], []]

        def ask(i: int) -> None:
            results[i] = client_times(bases[i], prompts)

        threads = [threading.Thread(target=ask, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    figures["two replicas: HTTP lookups/s (a client each, together)"] = sum(
        len(r) / sum(r) for r in results
    )
    for i, name in enumerate("ab"):
        p50, p99 = percentiles_ms(results[i])
        figures[f"two replicas: {name} p50 ms"] = p50
        figures[f"two replicas: {name} p99 ms"] = p99
    return figures


if __name__ == "__main__":
    main()
