"""`kvledger serve`'s HTTP face under attack, beside uvicorn's own protocol in the same run.

For each server protocol (uvicorn's httptools, the baseline; kvledger's, within its limits:
serving/lookup/guarded_protocol.py) a child process serves the lookup service from memory
(a router index filled from a simulated fleet) and an honest client asks POST /v1/match on
one kept-alive connection: quiet first, then while an attacker holds up to
``--connections`` half-open connections (slowloris: a request head a few bytes at a time,
each closed one opened again) and ``--header-streams`` connections send 64 MiB header
values. Figures: the honest p50/p99 quiet and under attack, the server's RSS growth, how
many of the honest client's new connections were refused or reset under attack, and the
share of a core the server and the attacker each spent while the honest client measured
(here they share two cores: the attacker's own work weighs on the honest tail too). Then,
the attack over, what one attacking connection costs the server: its CPU time per connection opened,
sent part of a head and closed (by the server at its connection limit, or by the client),
over ``CHURN`` connections with 4,200 held open.

`python -m bench.http_attack` runs it alone and writes
bench/results/http-attack-<date>.{json,md}; `make bench` runs it with the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from bench.common import PUBLISHED, publish, record

HEAD = b"POST /v1/match HTTP/1.1\r\nhost: bench\r\n"
CHURN, HELD = 20_000, 4_200


# ---------------------------------------------------------------------- the server
def serve(protocol_name: str, port: int, ready: Any) -> None:
    """The lookup service from memory on ``port`` (a child process)."""
    import logging

    import uvicorn

    from kvledger.consumer.pipeline import run_batch
    from kvledger.fleet import FleetConfig
    from kvledger.process import collect_less_often, freeze_startup_objects
    from kvledger.schemas.codec import Codec
    from kvledger.serving.lookup.guarded_protocol import HttpLimits
    from kvledger.serving.lookup.hot_protocol import protocol
    from kvledger.serving.lookup.http import ServiceConfig, create_app
    from kvledger.serving.router.index import RouterIndex
    from tests.helpers.streams import fleet_stream

    logging.getLogger("kvledger").setLevel(logging.ERROR)  # the refusals' counts
    _open_files()
    router = RouterIndex("127.0.0.1:9", "t", "g")  # never started: filled here
    messages = fleet_stream(FleetConfig(instances=4, requests=400, seed=7)).messages
    for i in range(0, len(messages), 500):
        run_batch(messages[i : i + 500], Codec(), router.store, "g")
    app = create_app(ServiceConfig(router=router, silent_after=timedelta(days=9999)))
    http: Any = "httptools"
    if protocol_name == "kvledger":
        http = protocol(app, HttpLimits())
    freeze_startup_objects()  # as `kvledger serve` does before it serves (both protocols)
    collect_less_often()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="critical",
                            access_log=False, proxy_headers=False, lifespan="off",
                            backlog=4096)  # fmt: skip
    server = uvicorn.Server(config)
    ready.set()
    server.run()


def _open_files() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_s(pid: int) -> float:
    """The process's user and system CPU time so far, in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ---------------------------------------------------------------------- the attacker
def attack(port: int, connections: int, header_streams: int, stop: Any) -> None:
    """Slowloris and endless headers until ``stop`` (a child process, at the lowest
    priority: here it shares the server's cores, which a remote attacker would not)."""
    os.nice(19)
    _open_files()
    asyncio.run(_attack(port, connections, header_streams, stop))


async def _attack(port: int, connections: int, header_streams: int, stop: Any) -> None:
    async def slow() -> None:
        while not stop.is_set():
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(HEAD)
                while not stop.is_set():
                    await asyncio.sleep(5)
                    writer.write(b"x-a: b\r\n")
                    await writer.drain()
            except OSError:
                await asyncio.sleep(0.5)

    async def endless() -> None:
        chunk = b"a" * (1 << 20)
        while not stop.is_set():
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(HEAD + b"x-big: ")
                for _ in range(64):
                    writer.write(chunk)
                    await writer.drain()
                await asyncio.sleep(1)
                writer.close()
            except OSError:
                await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(endless()) for _ in range(header_streams)]
    for i in range(connections):
        tasks.append(asyncio.create_task(slow()))
        if i % 500 == 499:
            await asyncio.sleep(0.05)
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for t in tasks:
        t.cancel()


async def churn(port: int, connections: int, held: int) -> None:
    """``held`` connections open with part of a head, then ``connections`` more, one at a
    time, the client closing its oldest beyond ``held`` + 50 (at its limit the server
    closes some first)."""
    open_ = []
    for _ in range(held + connections):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD)
        open_.append(writer)
        if len(open_) > held + 50:
            open_.pop(0).close()
    for writer in open_:
        writer.close()


# ---------------------------------------------------------------------- the honest client
def _body() -> bytes:
    from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts

    fleet = FleetConfig(instances=4, requests=400, seed=7)
    prompt = system_prompts(fleet)[0] + [1, 2, 3]
    hashes = [h.hex() for h in prompt_hashes(prompt, fleet, int64=False)]
    return json.dumps({"model": fleet.model, "hashes": hashes, "include_silent": True}).encode()


def honest(port: int, seconds: float, body: bytes) -> list[float]:
    """Latencies (s) of /v1/match on one kept-alive connection for ``seconds``; a failure
    counts as the time it took and reconnects."""
    end = time.monotonic() + seconds
    return lookups_while(port, body, lambda: time.monotonic() < end)


def lookups_while(
    port: int, body: bytes, going: Callable[[], bool], timeout: float = 30.0
) -> list[float]:
    """Latencies (s) of /v1/match asked one after another on one kept-alive connection while
    ``going()``; a failure counts as the time it took and reconnects."""
    out: list[float] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    while going():
        start = time.perf_counter()
        try:
            conn.request("POST", "/v1/match", body, {"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            ok = answer.status == 200
        except (OSError, http.client.HTTPException):
            ok = False
        out.append(time.perf_counter() - start)
        if not ok:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        time.sleep(0.005)
    conn.close()
    return out


def fresh(port: int, tries: int, body: bytes) -> int:
    """How many of ``tries`` requests, each on a new connection, failed."""
    failed = 0
    for _ in range(tries):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("POST", "/v1/match", body, {"content-type": "application/json"})
            failed += conn.getresponse().status != 200
        except (OSError, http.client.HTTPException):
            failed += 1
        finally:
            conn.close()
        time.sleep(0.05)
    return failed


def p(values: list[float], q: int) -> float:
    """The ``q``th percentile in ms (the one value, when only one request finished)."""
    if len(values) < 2:
        return values[0] * 1e3 if values else float("nan")
    return statistics.quantiles(values, n=100)[q - 1] * 1e3


def one(
    protocol_name: str, connections: int, header_streams: int, seconds: float
) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=serve, args=(protocol_name, port, ready), daemon=True)
    server.start()
    ready.wait(120)
    body = _body()
    deadline = time.monotonic() + 60
    while fresh(port, 1, body):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {protocol_name} server did not answer")
    assert server.pid is not None
    quiet = honest(port, seconds, body)
    rss_quiet = rss_mib(server.pid)
    attacker = ctx.Process(target=attack, args=(port, connections, header_streams, stop))
    attacker.start()
    time.sleep(min(20.0, 3 + connections / 2000))  # the connections opened
    assert attacker.pid is not None
    server_cpu, attacker_cpu = cpu_s(server.pid), cpu_s(attacker.pid)
    loaded = honest(port, seconds, body)
    server_cpu, attacker_cpu = cpu_s(server.pid) - server_cpu, cpu_s(attacker.pid) - attacker_cpu
    refused = fresh(port, 40, body)
    rss_attacked = rss_mib(server.pid)
    stop.set()
    attacker.join(30)
    attacker.kill()
    _open_files()  # then, quiet again, the cost of one attacking connection
    before = cpu_s(server.pid)
    asyncio.run(churn(port, CHURN, HELD))
    time.sleep(1)  # the last closes seen
    per_connection_us = (cpu_s(server.pid) - before) / (CHURN + HELD) * 1e6
    server.kill()
    server.join(10)
    return {
        "p50_quiet_ms": p(quiet, 50), "p99_quiet_ms": p(quiet, 99),
        "p50_attacked_ms": p(loaded, 50), "p99_attacked_ms": p(loaded, 99),
        "p99_attacked_vs_quiet": p(loaded, 99) / max(p(quiet, 99), 1e-9),
        "answered_per_s_quiet": len(quiet) / seconds,
        "answered_per_s_attacked": len(loaded) / seconds,
        "rss_growth_mib": rss_attacked - rss_quiet,
        "server_cpu_share_attacked": server_cpu / seconds,
        "attacker_cpu_share": attacker_cpu / seconds,
        "new_connections_failed_of_40": refused,
        "server_cpu_us_per_connection": per_connection_us,
    }  # fmt: skip


def main(connections: int = 20_000, header_streams: int = 2, seconds: float = 10.0) -> None:
    figures: dict[str, Any] = {"attack_connections": connections,
                               "header_streams_64mib": header_streams}  # fmt: skip
    for name in ("uvicorn", "kvledger"):
        for key, value in one(name, connections, header_streams, seconds).items():
            figures[f"{name}_{key}"] = value
    record("http_attack", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.http_attack", description=__doc__)
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--header-streams", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    main(args.connections, args.header_streams, args.seconds)
    from bench.common import RESULTS

    data = {"http_attack": json.loads(RESULTS.read_text())["http_attack"]}
    written = publish(data, PUBLISHED / "http-attack", command="python -m bench.http_attack")
    print(f"wrote {', '.join(str(w) for w in written)}")
