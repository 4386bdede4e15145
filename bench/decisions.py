"""What a routing decision costs the lookup service, beside the lookup that preceded it.

A router asks ``POST /v1/match`` for a prompt, sends the prompt to the best holder, then
reports ``POST /v1/decisions`` (the instance becomes a provisional holder, and the record of
what was offered and captured is written for the other replicas and the consumer). Both
routes run on the service's event loop in memory mode, so a decision's cost is taken from
the lookups' time.

One in-memory router index holds a simulated fleet (8 engines, GPU and CPU tiers); each of
``--prompts`` prompts (a system prompt cut anywhere, then fresh tokens) is looked up, then
reported as sent to the lookup's best holder (or the first engine where none holds it),
through the service's own app in this process (Starlette's test client: the handler and
the framework, without sockets). The decision's record is encoded as the decisions topic
carries it; producing it is the Kafka client's queue put, not timed here. The per-client
rate limit is lifted: the handler's cost is measured, not the limit. Figures: p50 and p99
of each, and the ratio decision / lookup.

Dynamo's ``/query`` answers are recorded where decisions are: each answer is noted for the
decision log's thread, which builds its record later. Its cost on the lookup's path is
measured in the handler itself (``DynamoApi.query``, microseconds: the test client's own
cost would hide it), with and without recording, alternating prompt by prompt on one index;
then the records are built as the log's thread builds them, timed apart. Last, the same
handler with routers' decisions held (one per prompt of the first ``HELD``, prompt i sent to
engine i modulo the fleet's size, whether it holds the prompt or not): each answer is then
rescored with the provisional holders, its cost beside the plain answer's in the same loop.

`python -m bench.decisions` runs it alone (bench/results/decisions/); `make bench` with the
rest. No services.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from typing import Any

from starlette.testclient import TestClient

from bench.common import PUBLISHED, percentiles_ms, publish, record
from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.schemas.decisions import TOKENS, Decision, encode
from kvledger.serving.lookup import http
from kvledger.serving.lookup.dynamo import DynamoApi
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.provisional import Provisional, token_keys
from tests.helpers.streams import fleet_prompts, fleet_stream

FLEET = FleetConfig(instances=8, requests=200, seed=29, gpu_capacity_blocks=256)
HELD = 300  # decisions held for the provisional figure


def main(prompts: int = 3000) -> dict[str, Any]:
    router = RouterIndex("127.0.0.1:9", "t", "g")  # never started: filled here
    messages = fleet_stream(FLEET).messages
    for i in range(0, len(messages), 500):
        run_batch(messages[i : i + 500], Codec(), router.store, "g")
    written: list[bytes] = []
    http.DECISIONS_PER_CLIENT_S = 10**9  # the limit lifted (see the module docstring)
    app = http.create_app(http.ServiceConfig(
        router=router, provisional=Provisional(5.0),
        silent_after=timedelta(days=36500),  # the simulated engines stopped long ago
        share=lambda d, r: written.append(encode(d, r)),
    ))  # fmt: skip
    bodies = [
        {"model": FLEET.model, "token_ids": p} for p in fleet_prompts(FLEET, prompts, 7) if p
    ]  # (a prompt cut to nothing is no prompt)
    match_s, decide_s, held = [], [], 0
    with TestClient(app) as client:
        for body in bodies[:200]:  # warm
            client.post("/v1/match", json=body)
        for body in bodies:
            start = time.perf_counter()
            answer = client.post("/v1/match", json=body)
            match_s.append(time.perf_counter() - start)
            assert answer.status_code == 200, answer.text
            ranked = answer.json()["ranked"]
            instance = ranked[0]["instance"] if ranked else "engine-0"
            start = time.perf_counter()
            reported = client.post("/v1/decisions", json={**body, "instance": instance})
            decide_s.append(time.perf_counter() - start)
            assert reported.status_code == 202, reported.text
            held += bool(ranked)
    (match_p50, match_p99), (decide_p50, decide_p99) = map(percentiles_ms, (match_s, decide_s))
    figures = {
        "prompts": float(len(bodies)),
        "prompts with a holder": float(held),
        "records written": float(len(written)),
        "POST /v1/match ms, p50": match_p50,
        "POST /v1/match ms, p99": match_p99,
        "POST /v1/decisions ms, p50": decide_p50,
        "POST /v1/decisions ms, p99": decide_p99,
        "ratio decision / lookup, p50": decide_p50 / match_p50,
    }
    figures.update(dynamo_answers(bodies))
    record("decisions", figures)
    return figures


def dynamo_answers(bodies: list[dict[str, Any]]) -> dict[str, float]:
    """Dynamo's /query answered with and without recording it (see the module docstring)."""
    router = RouterIndex("127.0.0.1:9", dynamo=True)  # never started: filled here
    messages = fleet_stream(FLEET).messages
    for i in range(0, len(messages), 500):
        run_batch(messages[i : i + 500], Codec(), router.store, "g")
    noted: list[Any] = []
    window = timedelta(days=36500)
    plain = DynamoApi(router, window)
    recording = DynamoApi(router, window, record=lambda a, build: noted.append((a, build)))
    held = Provisional(3600.0)
    block_size = router.block_size(FLEET.model, 0)
    assert block_size is not None
    for i, body in enumerate(bodies[:HELD]):
        keys = token_keys(body["token_ids"], block_size, None, None)
        held.add(Decision(FLEET.model, 0, f"engine-{i % FLEET.instances}", TOKENS, tuple(keys)))
    provisional = DynamoApi(router, window, provisional=held)
    raws = [json.dumps({"token_ids": b["token_ids"], "model_name": FLEET.model}).encode()
            for b in bodies]  # fmt: skip
    apis = {"plain": plain, "recording": recording, "provisional": provisional}
    for raw in raws[:200]:  # warm
        for api in apis.values():
            api.query(raw, False)
    del noted[:]
    times: dict[str, list[float]] = {kind: [] for kind in apis}
    for raw in raws:
        for kind, api in apis.items():
            start = time.perf_counter()
            api.query(raw, False)
            times[kind].append(time.perf_counter() - start)
    start = time.perf_counter()
    built = [encode(answered, build()) for answered, build in noted]
    build_s = time.perf_counter() - start
    off_p50, on_p50, held_p50 = (percentiles_ms(times[kind])[0]
                                 for kind in ("plain", "recording", "provisional"))  # fmt: skip
    return {
        "Dynamo /query handler µs, p50": off_p50 * 1000,
        "Dynamo /query handler recording its answer µs, p50": on_p50 * 1000,
        "recording an answer, added µs, p50": (on_p50 - off_p50) * 1000,
        "answer records built on the log's thread, µs each": build_s / len(built) * 1e6,
        f"Dynamo /query handler with {HELD} decisions held µs, p50": held_p50 * 1000,
        "ratio with decisions held / plain, p50": held_p50 / off_p50,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.decisions", description=__doc__)
    parser.add_argument("--prompts", type=int, default=3000)
    args = parser.parse_args()
    out = publish({"decisions": main(args.prompts)}, PUBLISHED / "decisions",
                  command="python -m bench.decisions")  # fmt: skip
    print(f"wrote {', '.join(str(p) for p in out)}")
