"""Dynamo's `POST /query` from kvledger beside Dynamo's own indexer, in one run.

A simulated fleet (8 engines, GPU, CPU and STORAGE tiers) goes into a fresh database; then
`kvledger serve --memory --dynamo-api` serves it, and Dynamo's standalone indexer
(``python -m dynamo.indexer`` from ai-dynamo-runtime 1.6.1, the bench extra) starts with
``--peers`` at kvledger, so both hold the same index. One client (httpx, keep-alive) sends
the same prompts' token ids to both, each prompt to one and then the other (which goes first
alternates), so both are timed under the same moment's load; every answer pair is compared.

Figures: p50/p99 per request and requests/s for each, their ratios, and whether every
answer agreed.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from typing import Any

from confluent_kafka.admin import AdminClient

from bench.common import lookup_service, reader_args, record
from bench.consume import _database
from kvledger.fleet import FleetConfig, random_tokens, system_prompts
from kvledger.schemas.topics import ensure_topic
from kvledger.simulate_cmd import run_simulation

FLEET = FleetConfig(instances=8, requests=120, seed=23, gpu_capacity_blocks=256)
PROMPTS = 2400


def _prompts(count: int) -> list[list[int]]:
    rng, systems = random.Random(29), system_prompts(FLEET)
    out = []
    for _ in range(count):
        base = rng.choice(systems)
        out.append(base[: rng.randrange(32, len(base) + 1)] + random_tokens(rng, 200))
    return out


def _dynamo_indexer(peer: str) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--peers", peer],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    probe = {"token_ids": [1], "model_name": FLEET.model}
    while True:
        try:
            if httpx.post(f"{base}/query", json=probe).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("Dynamo's indexer did not recover from kvledger within 60 s")
        time.sleep(0.3)


def _alternating(
    client: Any, urls: tuple[str, str], bodies: list[dict[str, Any]]
) -> list[tuple[list[float], list[Any]]]:
    """Each body to both URLs, one after the other, the first of the pair alternating:
    both servers are timed under the same moment's load. Per URL: seconds per request
    and the answers."""
    out: list[tuple[list[float], list[Any]]] = [([], []), ([], [])]
    for i, body in enumerate(bodies):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            start = time.perf_counter()
            r = client.post(urls[side], json=body)
            out[side][0].append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
            out[side][1].append(r.json())
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def main() -> dict[str, float]:
    import httpx

    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    db = _database(os.environ["KVLEDGER_DATABASE_URL"], "kvledger_bench_dynamo")
    topic = f"bench-dynamo-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    ensure_topic(admin, topic, 6)
    run_simulation(bootstrap, topic, FLEET, partitions=6, show_progress=False)
    subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "consume", "--bootstrap", bootstrap,
         "--database-url", db, "--topic", topic, "--consumer-group", "bench-dynamo",
         "--until-caught-up", "--no-migrate", "--dlq-topic", f"{topic}.dlq"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    args = [*reader_args(db), "--memory", "--dynamo-api", "--bootstrap", bootstrap, "--topic",
            topic, "--consumer-group", "bench-dynamo", "--silent-after", "86400"]  # fmt: skip
    prompts = _prompts(PROMPTS)
    bodies = [{"token_ids": p, "model_name": FLEET.model} for p in prompts]
    with lookup_service(args, start_timeout_s=60) as kvledger:
        proc, dynamo = _dynamo_indexer(kvledger)
        try:
            with httpx.Client() as client:
                urls = (f"{kvledger}/query", f"{dynamo}/query")
                _alternating(client, urls, bodies[:200])  # warm both
                (ours, ours_answers), (theirs, their_answers) = _alternating(client, urls, bodies)
        finally:
            proc.terminate()
            proc.wait(30)
    agree = ours_answers == their_answers
    admin.delete_topics([topic, f"{topic}.dlq"])
    figures = {
        "prompts": float(len(ours)),
        "kvledger POST /query p50 us": _pct(ours, 0.5),
        "kvledger POST /query p99 us": _pct(ours, 0.99),
        "kvledger POST /query requests/s (one client)": len(ours) / sum(ours),
        "Dynamo indexer POST /query p50 us": _pct(theirs, 0.5),
        "Dynamo indexer POST /query p99 us": _pct(theirs, 0.99),
        "Dynamo indexer POST /query requests/s (one client)": len(theirs) / sum(theirs),
        "  p50 ratio kvledger / Dynamo": _pct(ours, 0.5) / _pct(theirs, 0.5),
        "  p99 ratio kvledger / Dynamo": _pct(ours, 0.99) / _pct(theirs, 0.99),
        "same answers (every prompt)": float(agree),
    }
    record("dynamo_api", figures)
    return figures


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key:64s} {value:14,.2f}")
