"""A hybrid model's lookups: the attention prefix each instance holds and the deepest
state checkpoint (vLLM 0.34's recurrent groups) within it, asked with ``state_group``,
answered alike from PostgreSQL (a real server) and from memory, over HTTP too."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvledger.consumer.db import connect
from kvledger.consumer.pipeline import run_batch
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.router.index import RouterIndex
from tests.helpers.streams import MODEL, Stream, checkpoint, h, removed, spec, stored

pytestmark = pytest.mark.integration

A, B, C = "engine-a", "engine-b", "engine-c"
PROMPT = [h(i) for i in range(1, 7)]


def hybrid() -> Stream:
    s = Stream()
    for source in (A, B, C):
        s.send(source, spec(0, block=4, hash_size=4))
        s.send(source, spec(1, kind="mamba", block=4, hash_size=4))
    s.send(A, stored([1, 2, 3, 4, 5, 6]))  # the whole prompt's attention blocks
    for at in (2, 4, 6):
        s.send(A, checkpoint(at, parent=at - 1, size=4, group=1))
    s.send(A, removed([6], group=1))  # its deepest state, gone: 4 is left
    s.send(B, stored([1, 2, 3], medium="GPU"))  # three blocks, on GPU
    s.send(B, checkpoint(2, parent=1, size=4, group=1))
    s.send(B, checkpoint(5, parent=4, size=4, group=1))  # past its prefix: of no use
    s.send(C, stored([1, 2]))  # attention blocks, no state at all
    return s


def test_sql_and_memory_say_where_each_instances_usable_state_is(fresh_database: str) -> None:
    stream = hybrid()
    with connect(fresh_database) as conn:
        run_batch(stream.messages, stream.codec, PostgresStore(conn), "g")
        conn.commit()
    router = RouterIndex("127.0.0.1:9", "t", "g")  # never started: filled here
    run_batch(stream.messages, stream.codec, router.store, "g")
    want = {A: 4, B: 2}
    upto = {A: 6, B: 3, C: 2}
    with connect(fresh_database, autocommit=True) as conn:
        index = PrefixIndex(conn)
        holders = index.match(MODEL, 0, PROMPT, include_silent=True)  # the stream's old clock
        assert {x.instance: x.matched_blocks for x in holders} == upto
        assert index.state_checkpoints(MODEL, 1, PROMPT, upto) == want
        assert index.state_checkpoints(MODEL, 1, PROMPT, {A: 3, B: 1}) == {A: 2}
        assert index.state_checkpoints(MODEL, 0, PROMPT, {C: 2}) == {C: 2}  # any group held
    assert router.state_checkpoints(MODEL, 1, PROMPT, upto) == want
    assert router.state_checkpoints(MODEL, 1, PROMPT, {A: 3, B: 1}) == {A: 2}
    assert router.state_checkpoints(MODEL, 9, PROMPT, upto) == {}

    body = {"model": MODEL, "hashes": [x.hex() for x in PROMPT], "state_group": 1,
            "include_silent": True}  # fmt: skip
    memory = TestClient(create_app(ServiceConfig(router=router)))
    answer = memory.post("/v1/match", json=body).json()
    assert answer["state_checkpoints"] == want
    assert {x["instance"]: x["matched_blocks"] for x in answer["holders"]} == upto
    sql = create_app(ServiceConfig(fresh_database, allow_writer=True))
    with TestClient(sql) as client:
        assert client.post("/v1/match", json=body).json()["state_checkpoints"] == want
        without = client.post("/v1/match", json={**body, "state_group": None}).json()
        assert "state_checkpoints" not in without
        for bad, why in [
            ({**body, "state_group": -1}, "state_group must be"),
            ({**body, "granularity": "hash"}, "applies to block hashes"),
            ({"model": MODEL, "token_ids": [1, 2], "state_group": 1}, "not token_ids"),
        ]:
            r = client.post("/v1/match", json=bad)
            assert r.status_code == 400 and why in r.json()["error"], r.text
