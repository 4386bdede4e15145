"""Provisional holders through real Kafka and PostgreSQL: two replicas of `kvledger serve
--memory --dynamo-api` share one decisions topic; a decision reported to one is answered by
the other (in /v1/match and in Dynamo's /query) until the engine's own events confirm the
blocks or the window passes, and never reaches the durable index."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx
import pytest

from kvledger.client import LookupClient
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.schemas.events import BlockStored, GroupSpec
from tests.helpers.consuming import consume
from tests.helpers.procs import first_answer, free_port, spawn, until

pytestmark = pytest.mark.integration

MODEL, BLOCK = "m-provisional", 4
PROMPT = list(range(1000, 1032))  # 8 full blocks
OTHER = list(range(5000, 5016))  # 4 full blocks
WINDOW_S = 3.0


def stored(tokens: list[int], salt: int) -> BlockStored:
    """The prompt's full blocks as one store, with hashes of this engine's own."""
    n = len(tokens) // BLOCK
    hashes = tuple((salt * 1000 + j).to_bytes(8, "big") for j in range(n))
    return BlockStored(hashes, None, tuple(tokens[: n * BLOCK]), BLOCK, None, "GPU", None,
                       group_idx=0, token_start=0)  # fmt: skip


def engine(bootstrap: str, topic: str, name: str) -> KVEventPublisher:
    pub = KVEventPublisher(PublisherConfig(bootstrap, name, MODEL, topic=topic,
                                           heartbeat_interval_s=0))  # fmt: skip
    pub.announce_group_spec(GroupSpec(MODEL, 0, "full_attention", BLOCK, BLOCK))
    return pub


def match(url: str, tokens: list[int]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/match", json={"model": MODEL, "token_ids": tokens}, timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def holders(url: str, tokens: list[int]) -> dict[str, tuple[int, bool]]:
    return {h["instance"]: (h["matched_blocks"], h.get("provisional", False))
            for h in match(url, tokens)["holders"]}  # fmt: skip


def decide(url: str, instance: str, tokens: list[int], **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "instance": instance, "token_ids": tokens, **extra}
    return httpx.post(f"{url}/v1/decisions", json=body, timeout=10)


def test_replicas_share_decisions_until_the_engine_confirms_them(
    kafka_bootstrap, fresh_database, as_reader, make_topic, group_id, tmp_path
) -> None:
    topic = make_topic("provisional", partitions=3)
    decisions = make_topic("decisions", partitions=1)  # any retention will do
    a, b = engine(kafka_bootstrap, topic, "engine-a"), engine(kafka_bootstrap, topic, "engine-b")
    a.publish_events([stored(PROMPT[:8], 1)])  # a holds the prompt's first 2 blocks
    b.publish_events([stored(OTHER, 2)])  # b holds something else
    a.flush()
    b.flush()

    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the children write it
    urls = []
    for _ in range(2):
        port = free_port()
        spawn([sys.executable, "-m", "kvledger", "serve", "--memory", "--dynamo-api",
               "--database-url", as_reader(fresh_database), "--bootstrap", kafka_bootstrap,
               "--topic", topic, "--consumer-group", group_id, "--port", str(port),
               "--decisions-topic", decisions, "--provisional-window", str(WINDOW_S)],
              stdout=log, stderr=log)  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        first_answer(f"{url}/healthz", "kvledger serve", timeout=60)
        until("the index", lambda url=url: holders(url, PROMPT) == {"engine-a": (2, False)})
    one, two = urls

    # Reported to one replica: answered by the other, as provisional, with b in flight.
    r = decide(one, "engine-b", PROMPT, request_id="req-1")
    assert r.status_code == 202, r.text
    assert r.json() == {"instance": "engine-b", "provisional_blocks": 8,
                        "expires_in_s": WINDOW_S}  # fmt: skip
    assert holders(one, PROMPT)["engine-b"] == (8, True)  # at once where it was reported
    until("the other replica", lambda: holders(two, PROMPT).get("engine-b") == (8, True))
    body = match(two, PROMPT)
    assert body["in_flight"] == {"engine-b": 1}
    assert body["ranked"][0]["instance"] == "engine-b"
    assert holders(two, PROMPT[:12])["engine-b"] == (3, True)  # a prefix of what was sent
    assert "engine-b" not in holders(two, list(range(1, 33)))  # another prompt: nothing
    workers = {w["kvledger_source"]: w["instance_id"] for w in httpx.get(f"{two}/workers").json()}
    q = httpx.post(f"{two}/query", json={"token_ids": PROMPT, "model_name": MODEL}).json()
    wid = str(workers["engine-b"])
    assert q["scores"][wid] == {"0": 8 * BLOCK} and q["provisional"] == {wid: 8 * BLOCK}
    assert q["scores"][str(workers["engine-a"])] == {"0": 2 * BLOCK}

    # The engine's own events confirm it: a real holder, no longer in flight, on both.
    b.publish_events([stored(PROMPT, 3)])
    b.flush()
    for url in urls:
        until("confirmed", lambda url=url: holders(url, PROMPT).get("engine-b") == (8, False))
        assert match(url, PROMPT)["in_flight"] == {}

    # Never a residency in the durable index: only what the engines stored.
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    from kvledger.consumer.db import connect

    with connect(fresh_database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT instance, count(*) FROM kvledger.residencies GROUP BY instance"
        ).fetchall()
    assert dict(rows) == {"engine-a": 2, "engine-b": 4 + 8}

    # A decision nobody confirms lasts the window, then is gone everywhere.
    assert LookupClient(two).decide(MODEL, "engine-a", token_ids=OTHER) == 4  # the client's way
    until("shared", lambda: holders(one, OTHER).get("engine-a") == (4, True))
    time.sleep(WINDOW_S + 0.5)
    for url in urls:
        assert "engine-a" not in holders(url, OTHER)
        assert LookupClient(url).match(MODEL, token_ids=OTHER).in_flight == {}

    scrape = httpx.get(f"{one}/metrics", timeout=10).text
    for line in ('kvledger_provisional_decisions_total{outcome="confirmed"} 1.0',
                 'kvledger_provisional_decisions_total{outcome="expired"} 1.0',
                 "kvledger_provisional_added_total 2.0", "kvledger_provisional_held 0.0",
                 'kvledger_decisions_records_total{outcome="shared"} 1.0'):  # fmt: skip
        assert line in scrape, scrape

    # Refusals name the field.
    for body, why in [
        ({"model": MODEL, "instance": "engine-z", "token_ids": PROMPT}, "instance"),
        ({"model": "nope", "instance": "engine-a", "token_ids": PROMPT}, "model"),
        ({"model": MODEL, "token_ids": PROMPT}, "instance"),
        ({"model": MODEL, "instance": "engine-a"}, "token_ids"),
        ({"model": MODEL, "instance": "engine-a", "token_ids": PROMPT, "x": 1}, "x"),
        ({"model": MODEL, "instance": "\ud800", "token_ids": PROMPT}, "text"),
    ]:
        r = httpx.post(f"{one}/v1/decisions", content=json.dumps(body), timeout=10,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and why in r.json()["error"], (body, r.text)
    a.close()
    b.close()


def test_the_sql_service_says_decisions_need_memory(
    fresh_database, as_reader, tmp_path
) -> None:  # fmt: skip
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the child writes it
    service = spawn([sys.executable, "-m", "kvledger", "serve", "--database-url",
                     as_reader(fresh_database), "--port", str(port)],
                    stdout=log, stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        first_answer(f"{url}/healthz", "kvledger serve", timeout=60)
        r = decide(url, "engine-a", PROMPT)
        assert r.status_code == 400 and "--memory" in r.json()["error"]
    finally:  # its pool holds connections the database's drop would wait for
        service.terminate()
        service.wait(30)
