"""Dynamo's released indexer as kvledger's client, through real Kafka and PostgreSQL: a
simulated fleet's life in the index, `kvledger serve --memory --dynamo-api` over it, and
Dynamo's standalone indexer (``python -m dynamo.indexer`` from ai-dynamo-runtime 1.6.1)
started with ``--peers`` at kvledger: it recovers kvledger's state from /dump and answers
/query as kvledger's /query does, which agrees with kvledger's own /v1/match. Dynamo's
selection service (``--indexer-peers``) recovers the same blocks and, with the workers
registered with it, scores and selects on them as kvledger's /query says."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from kvledger.fleet import FleetConfig
from kvledger.simulate_cmd import run_simulation
from tests.helpers.consuming import consume
from tests.helpers.procs import first_answer, free_port, require_dynamo, spawn
from tests.helpers.streams import fleet_prompts
from tests.test_router import LORA, lora_chain

pytestmark = pytest.mark.integration
require_dynamo()


def post(url: str, body: dict[str, Any]) -> Any:
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def blocks_of(dump: dict[str, Any]) -> set[tuple[str, int, str, int]]:
    """(partition, worker, tier, block id) of every block a /dump stores."""
    out = set()
    for key, entry in dump.items():
        for e in entry["events"]:
            for block in e["event"]["data"]["stored"]["blocks"]:
                out.add((key, e["worker_id"], e["storage_tier"], block["block_hash"]))
    return out


def ready(url: str, body: dict[str, Any], what: str, timeout: float = 60) -> None:
    """Wait until ``url`` answers ``body`` with a 200 (an indexer recovering from peers
    answers 404 until it has)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.post(url, json=body, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} never answered /query"
        time.sleep(0.3)


def test_dynamos_indexer_recovers_from_kvledger_and_answers_as_it_does(
    kafka_bootstrap, fresh_database, as_reader, make_topic, group_id, tmp_path
) -> None:
    topic = make_topic("dynamo-api", partitions=3)
    fleet = FleetConfig(
        instances=4, requests=60, seed=41, gpu_capacity_blocks=64, restart=("engine-1", 30)
    )
    run_simulation(kafka_bootstrap, topic, fleet, 3, False)
    lora_prompt = lora_chain(kafka_bootstrap, topic, fleet)
    consume(kafka_bootstrap, fresh_database, topic, group_id)

    port = free_port()
    kvledger = f"http://127.0.0.1:{port}"
    serve_log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the child writes it
    spawn(
        [sys.executable, "-m", "kvledger", "serve", "--memory", "--dynamo-api",
         "--database-url", as_reader(fresh_database), "--bootstrap", kafka_bootstrap,
         "--topic", topic, "--consumer-group", group_id, "--port", str(port),
         "--silent-after", "86400"],
        stdout=serve_log, stderr=serve_log,
    )  # fmt: skip
    first_answer(f"{kvledger}/healthz", "kvledger serve", timeout=60)
    model = {"model_name": fleet.model}
    ready(f"{kvledger}/query", {"token_ids": [1], **model}, "kvledger")
    sql_port = free_port()  # the SQL-backed service, with Dynamo's API from a router of its own
    beside_sql = f"http://127.0.0.1:{sql_port}"
    sql_service = spawn(
        [sys.executable, "-m", "kvledger", "serve", "--dynamo-api",
         "--database-url", as_reader(fresh_database), "--bootstrap", kafka_bootstrap,
         "--topic", topic, "--consumer-group", group_id, "--port", str(sql_port),
         "--silent-after", "86400"],
        stdout=serve_log, stderr=serve_log,
    )  # fmt: skip
    ready(f"{beside_sql}/query", {"token_ids": [1], **model}, "kvledger (SQL mode)")
    try:
        compare(fleet, lora_prompt, kvledger, beside_sql, tmp_path)
    finally:  # its pool holds connections the database's drop would wait for
        sql_service.terminate()
        sql_service.wait(30)


def schedulable(selector: str, kvledger: str, model: str) -> None:
    """Every kvledger worker registered with Dynamo's selection service as Dynamo needs it
    to schedule one (an endpoint, the block size, a KV-event endpoint of its own, here with
    no publisher): the blocks it recovered from kvledger stay."""
    before = blocks_of(httpx.get(f"{selector}/dump", timeout=60).json())
    workers = httpx.get(f"{kvledger}/workers").json()
    ids = sorted({w["instance_id"] for w in workers if w["routing_group"] == "default"})
    for worker_id in ids:
        answer = httpx.post(
            f"{selector}/workers",
            json={"worker_id": worker_id, "model_name": model, "block_size": 32,
                  "endpoint": "http://127.0.0.1:9", "data_parallel_size": 1,
                  "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}"},
            timeout=30,
        )  # fmt: skip
        assert answer.status_code == 201 and answer.json()["lifecycle"] == "schedulable"
    assert httpx.get(f"{selector}/ready").json()["schedulable_workers"] == len(ids)
    assert blocks_of(httpx.get(f"{selector}/dump", timeout=60).json()) == before


def agrees_with_selection(selector: str, body: dict[str, Any], scores: dict[str, Any]) -> int:
    """Dynamo's selection service on kvledger's state: its overlap on GPU per worker is
    kvledger's score, and with one best GPU holder and no load anywhere it selects that
    holder. Returns 1 where the selection was compared (a single best holder)."""
    overlap = post(f"{selector}/overlap_scores", body)
    theirs = {
        str(w["worker_id"]): {str(w["dp_rank"]): w["device_blocks"] * overlap["block_size"]}
        for w in overlap["workers"]
        if w["device_blocks"]
    }
    assert theirs == scores
    best = max(ranks["0"] for ranks in scores.values())
    top = [worker for worker, ranks in scores.items() if ranks["0"] == best]
    if len(top) != 1:
        return 0
    chosen = post(f"{selector}/select", body)
    assert (str(chosen["worker_id"]), chosen["overlap"]["gpu"]) == (top[0], best)
    return 1


def compare(
    fleet: FleetConfig, lora_prompt: list[int], kvledger: str, beside_sql: str, tmp_path: Any
) -> None:
    """Dynamo's indexer and selection service started at ``kvledger``; /query from Dynamo's
    indexer, from kvledger and from the SQL mode's service compared; /v1/match beside."""
    model = {"model_name": fleet.model}
    dport = free_port()
    theirs = f"http://127.0.0.1:{dport}"
    dynamo_log = open(tmp_path / "dynamo.log", "w")  # noqa: SIM115
    spawn(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(dport), "--peers", kvledger],
        stdout=dynamo_log, stderr=dynamo_log,
    )  # fmt: skip
    ready(f"{theirs}/query", {"token_ids": [1], **model}, "Dynamo's indexer")

    sport = free_port()
    selector = f"http://127.0.0.1:{sport}"
    select_log = open(tmp_path / "select.log", "w")  # noqa: SIM115
    spawn(
        [sys.executable, "-m", "dynamo.select_service", "--port", str(sport),
         "--indexer-peers", kvledger],
        stdout=select_log, stderr=select_log,
    )  # fmt: skip
    first_answer(f"{selector}/health", "Dynamo's selection service", timeout=60)
    # Both of Dynamo's services begin with kvledger's state: their /dump holds the blocks
    # kvledger's does, per worker and tier.
    ours_dump = blocks_of(httpx.get(f"{kvledger}/dump", timeout=60).json())
    assert len(ours_dump) > 500
    assert blocks_of(httpx.get(f"{theirs}/dump", timeout=60).json()) == ours_dump
    deadline = time.monotonic() + 30
    while blocks_of(httpx.get(f"{selector}/dump", timeout=60).json()) != ours_dump:
        assert time.monotonic() < deadline, "the selection service did not recover kvledger's"
        time.sleep(0.5)

    schedulable(selector, kvledger, fleet.model)

    hits = lower = selected = 0
    for tokens in [*fleet_prompts(fleet, 520, 17), lora_prompt]:
        body = {"token_ids": tokens, **model}
        if tokens is lora_prompt:
            body["lora_name"] = LORA
        ours, dyn = post(f"{kvledger}/query", body), post(f"{theirs}/query", body)
        assert ours == dyn, tokens[:8]
        if hits < 100:
            assert post(f"{beside_sql}/query", body) == ours
        hits += bool(ours["scores"])
        lower += any(s["disk"] > s["gpu"] for s in ours["instances"].values())
        if tokens is lora_prompt:
            assert ours["instances"] and not ours["scores"]  # the adapter's blocks: CPU
            continue
        if not tokens:
            assert ours == {"scores": {}, "frequencies": [], "instances": {}}
            continue
        match = {"model": fleet.model, "token_ids": tokens, "silent_after_s": 86400}
        holders = post(f"{kvledger}/v1/match", match)["holders"]
        if hits < 100:  # the SQL functions' answer is the router's
            assert post(f"{beside_sql}/v1/match", match)["holders"] == holders
        gpu = {
            h["instance"].rsplit("-", 1)[1]: {"0": h["matched_blocks"] * 32}
            for h in holders
            if h["medium"] == "GPU" and h["matched_blocks"] > 0
        }
        assert ours["scores"] == gpu
        if gpu and selected < 60:
            selected += agrees_with_selection(selector, body, ours["scores"])
    assert hits > 150 and lower > 50 and selected >= 30
    workers = httpx.get(f"{kvledger}/workers").json()
    assert {w["kvledger_source"] for w in workers} >= {f"engine-{i}" for i in range(4)}


def test_the_first_steps_fleet_scores_on_dynamos_query(
    kafka_bootstrap, fresh_database, as_reader, make_topic, group_id, tmp_path
) -> None:
    """`simulate` as the README's first steps run it publishes a GPU tier, as engines do:
    Dynamo's `/query` (GPU scores) names the holders of the prompt it wrote. Before, the
    simulated engines had CPU and storage tiers only and `/query` answered `{}`."""
    topic = make_topic("first-steps-dynamo", partitions=3)
    prompt_file = tmp_path / "prompt.txt"
    done = subprocess.run(
        [sys.executable, "-m", "kvledger", "simulate", "--bootstrap", kafka_bootstrap,
         "--topic", topic, "--partitions", "3", "--instances", "2", "--requests", "20",
         "--prompt-out", str(prompt_file)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BlockStored" in done.stdout
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    port = free_port()
    kvledger = f"http://127.0.0.1:{port}"
    spawn(
        [sys.executable, "-m", "kvledger", "serve", "--memory", "--dynamo-api",
         "--database-url", as_reader(fresh_database), "--bootstrap", kafka_bootstrap,
         "--topic", topic, "--consumer-group", group_id, "--port", str(port),
         "--silent-after", "86400"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    first_answer(f"{kvledger}/healthz", "kvledger serve", timeout=60)
    body = {
        "model_name": "sim-llama-8b",
        "token_ids": [int(t) for t in prompt_file.read_text().split()],
    }
    ready(f"{kvledger}/query", body, "kvledger")
    answer = post(f"{kvledger}/query", body)
    assert answer["scores"], answer
    assert all(s > 0 for ranks in answer["scores"].values() for s in ranks.values())
