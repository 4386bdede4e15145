"""The lookup service over HTTP from memory (serving/lookup/door.py): POST /v1/match, a hot
route, answers every request (good, unauthorized, malformed, oversized) and counts it; the
root, the health check beside lookups. A router index filled through the pipeline, no
services."""

from __future__ import annotations

import json
import threading
import time

import pytest
from starlette.testclient import TestClient

from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts
from kvledger.schemas.codec import Codec
from kvledger.serving.lookup.door import Door
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.lookup.metrics import REQUESTS
from kvledger.serving.lookup.requests import MAX_BODY_BYTES
from kvledger.serving.router.index import Position, RouterIndex
from tests.helpers.streams import fleet_stream

FLEET = FleetConfig(instances=3, requests=40, seed=9)


@pytest.fixture(scope="module")
def router() -> RouterIndex:
    router = RouterIndex("127.0.0.1:9", "t", "g")  # never started: filled here
    messages = fleet_stream(FLEET).messages
    for i in range(0, len(messages), 200):
        run_batch(messages[i : i + 200], Codec(), router.store, "g")
    return router


def requests() -> list[tuple[dict[str, str], bytes]]:
    prompt = system_prompts(FLEET)[0] + [1, 2, 3]
    hashes = [h.hex() for h in prompt_hashes(prompt, FLEET, int64=False)]
    good = {"model": FLEET.model, "hashes": hashes, "silent_after_s": 9e8}  # a 2025 stream
    bearer = {"authorization": "Bearer s3cret"}
    return [
        (bearer, json.dumps(good).encode()),
        (bearer, json.dumps(good | {"granularity": "hash", "weights": {"GPU": 2}}).encode()),
        (bearer, json.dumps({"model": FLEET.model, "token_ids": prompt}).encode()),
        (bearer, json.dumps(good | {"include_silent": True, "silent_after_s": 0.001}).encode()),
        ({}, json.dumps(good).encode()),  # no token
        ({"authorization": "Bearer wrong"}, json.dumps(good).encode()),
        (bearer, b"{not json"),
        (bearer, b"[1, 2]"),
        (bearer, json.dumps(good | {"hashes": ["zz"]}).encode()),
        (bearer, json.dumps(good | {"at": "2026-01-01T00:00:00Z"}).encode()),  # SQL only
        (bearer, b" " * (MAX_BODY_BYTES + 1)),
    ]


def test_the_hot_route_answers_every_request_through_the_one_door(router: RouterIndex) -> None:
    """POST /v1/match from memory is a hot route (the protocol answers it in the parser's
    callbacks: tests/unit/test_hot_protocol.py holds those answers to the ASGI path's);
    through the door it answers every request with its status, headers and metrics."""
    app = create_app(ServiceConfig(router=router, token="s3cret"))
    assert isinstance(app, Door) and b"/v1/match" in app.hot
    with TestClient(app) as hot:
        statuses = []
        for headers, body in requests():
            before = REQUESTS.labels("match", "200")._value.get()
            a = hot.post("/v1/match", content=body, headers=headers)
            counted = REQUESTS.labels("match", "200")._value.get() - before
            assert a.headers["content-type"] == "application/json"
            assert int(a.headers["content-length"]) == len(a.content)
            assert (a.headers.get("www-authenticate") == "Bearer") == (a.status_code == 401)
            assert counted == (a.status_code == 200)
            statuses.append(a.status_code)
        assert statuses == [200, 200, 200, 200, 401, 401, 400, 400, 400, 400, 400]
        assert any(h["matched_blocks"] for h in hot.post(
            "/v1/match", content=requests()[0][1], headers=requests()[0][0]
        ).json()["holders"])  # fmt: skip
        # A body without Content-Length is refused before it is read.
        chunked = hot.post(
            "/v1/match", content=iter([b"{}"]), headers={"authorization": "Bearer s3cret"}
        )
        assert chunked.status_code == 400 and "Content-Length" in chunked.json()["error"]
        assert hot.get("/openapi.json", headers={}).json()["openapi"].startswith("3.1")
        assert hot.get("/v1/match").status_code == 405


def test_sql_mode_has_no_hot_path() -> None:
    with pytest.raises(ValueError, match="database URL or a router"):
        create_app(ServiceConfig())


def test_a_slow_healthz_does_not_hold_up_lookups(router: RouterIndex, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A router's /healthz asks the broker for the log end (seconds when it is away): it
    runs in the thread pool, and lookups on the event loop go on meanwhile."""

    def slow() -> Position:
        time.sleep(2)
        return Position({}, {}, 0, None, 0.0)

    monkeypatch.setattr(router, "position", slow)
    headers, body = requests()[0]
    with TestClient(create_app(ServiceConfig(router=router, token="s3cret"))) as client:
        health = threading.Thread(target=client.get, args=("/healthz",))
        health.start()
        time.sleep(0.2)  # the health check is in flight
        start = time.monotonic()
        assert client.post("/v1/match", content=body, headers=headers).status_code == 200
        waited = time.monotonic() - start
        health.join()
    assert waited < 1.0, waited


def test_a_salted_prompt_is_found_over_http_given_its_salt() -> None:
    """POST /v1/match with token_ids and cache_salt walks from the salt's first block (its
    only extra key is the salt, as vLLM sends a salted first block); without the salt, or
    with another, nothing is found."""
    from kvledger.schemas.events import BlockStored
    from tests.helpers.streams import MODEL, Stream, h, spec

    stream = Stream("t")
    stream.send("engine-0", spec(0))
    stream.send(
        "engine-0",
        BlockStored((h(1), h(2)), None, tuple(range(8)), 4, None, "GPU", None,
                    extra_keys=('["tenant-1"]', None), group_idx=0, token_start=0),
    )  # fmt: skip
    router = RouterIndex("127.0.0.1:9", "t", "g")
    run_batch(stream.messages, Codec(), router.store, "g")
    with TestClient(create_app(ServiceConfig(router=router))) as client:

        def found(**salt: str) -> list[tuple[str, int]]:
            body = {"model": MODEL, "token_ids": list(range(8)), "silent_after_s": 9e8, **salt}
            answer = client.post("/v1/match", json=body)
            assert answer.status_code == 200, answer.text
            return [(x["instance"], x["matched_blocks"]) for x in answer.json()["holders"]]

        assert found(cache_salt="tenant-1") == [("engine-0", 2)]
        assert found() == [] and found(cache_salt="tenant-2") == []


def test_the_root_says_what_the_service_is_and_answers(router: RouterIndex) -> None:
    """GET / was a 404: it names the service, its mode and its routes, with no token."""
    client = TestClient(create_app(ServiceConfig(router=router, token="s3cret")))
    answer = client.get("/")
    assert answer.status_code == 200
    body = answer.json()
    assert (body["mode"], body["openapi"]) == ("memory", "/openapi.json")
    assert {"POST /v1/match", "GET /healthz", "GET /openapi.json"} <= set(body["routes"])
    assert client.get(body["openapi"]).json()["paths"]["/"]["get"]["operationId"] == "index"
