"""No body is a 500: every POST route of the service from memory with Dynamo's API, given
bodies generated from each route's own fields (any JSON value in any of them, strings with
lone surrogates, non-ASCII digits, deep nesting, unknown fields) and from raw bytes, answers
with a 2xx or a 4xx that says why. A router index filled through the pipeline, no services.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.provisional import Provisional
from tests.helpers.streams import fleet_stream

FLEET = FleetConfig(instances=2, requests=20, seed=3)
FIELDS = {
    "/v1/match": ["model", "group_idx", "weights", "hashes", "token_ids", "granularity", "at",
                  "lora_name", "cache_salt", "include_silent", "silent_after_s", "state_group"],
    "/query": ["token_ids", "model_name", "routing_group", "lora_name", "cache_salt"],
    "/query_by_hash": ["block_hashes", "model_name", "routing_group", "cache_salt"],
    "/register": ["instance_id", "model_name", "endpoint", "block_size", "routing_group",
                  "source"],
    "/unregister": ["instance_id", "model_name", "routing_group"],
    "/v1/decisions": ["model", "group_idx", "instance", "hashes", "token_ids", "lora_name",
                      "cache_salt", "request_id"],
}  # fmt: skip


@pytest.fixture(scope="module")
def client() -> TestClient:
    router = RouterIndex("127.0.0.1:9", "t", "g", dynamo=True)  # never started: filled here
    messages = fleet_stream(FLEET).messages
    for i in range(0, len(messages), 200):
        run_batch(messages[i : i + 200], Codec(), router.store, "g")
    config = ServiceConfig(
        router=router,
        dynamo_api=True,
        silent_after=timedelta(days=9999),
        provisional=Provisional(5.0),
    )
    app = create_app(config)
    return TestClient(app)


# Text with what once made a 500: lone surrogates, non-ASCII digits, NUL, the model's name.
text = st.one_of(
    st.text(st.characters(codec=None, categories=None), max_size=12),
    st.sampled_from(
        ["\ud800", "\udfff", "\u00b2", "\u0661", "\x00", "default", FLEET.model, "engine-0"]
    ),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), text
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)
), max_leaves=12)  # fmt: skip


def body_of(route: str) -> st.SearchStrategy[bytes]:
    """A JSON object over the route's own fields (each any value) and strange ones, written
    with escapes (a lone surrogate travels as ``\\ud800``)."""
    fields = st.dictionaries(st.sampled_from(FIELDS[route]), values, max_size=6)
    extra = st.dictionaries(text, values, max_size=2)
    return st.builds(lambda a, b: json.dumps({**b, **a}).encode(), fields, extra)


def deep(n: int) -> bytes:
    return b'{"model": ' + b"[" * n + b"]" * n + b"}"


@pytest.mark.parametrize("route", sorted(FIELDS))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_no_body_is_a_500(client: TestClient, route: str, data: Any) -> None:
    odd = st.sampled_from([deep(100_000), b"[" * 100_000, b"\xff{}"])
    raw = data.draw(st.one_of(body_of(route), st.binary(max_size=64), odd))
    answer = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code < 500, (route, raw[:200], answer.text[:300])
    if answer.status_code >= 400:
        assert answer.json()["error"]
