"""Dynamo's KV-indexer API over the router index (serving/lookup/dynamo.py), without
services: a simulated fleet's stream through the router store, then Dynamo's routes asked
over HTTP. Dynamo's own RadixTree (the ai-dynamo-runtime 1.6.1 wheel), fed kvledger's
/dump, scores every prompt as kvledger's /query does; refusals have Dynamo's status codes.
tests/test_dynamo_api.py runs Dynamo's indexer itself against a served kvledger."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvledger.consumer.core.model import SourceLife
from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.schemas.dynamo import dynamo_seed
from kvledger.serving.lookup import dynamo as api
from kvledger.serving.lookup import dynamo_requests as requests
from kvledger.serving.lookup import dynamo_workers
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.router import groups
from kvledger.serving.router import store as store_module
from kvledger.serving.router.index import RouterIndex
from tests.helpers.group_kinds import KINDS, use_group_kind
from tests.helpers.pure_router.group import PureGroup
from tests.helpers.streams import fleet_prompts, fleet_stream

if os.environ.get("CI") == "true":  # CI installs the dev extra: no skipping there
    import dynamo._core as dynamo
else:
    dynamo = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime (the dev extra)")

FLEET = FleetConfig(instances=4, requests=40, seed=41, gpu_capacity_blocks=64)
MODEL = FLEET.model
WIDE = timedelta(days=3650)  # a replayed stream's sources are all "live" within it


@pytest.fixture(params=KINDS)
def router(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> RouterIndex:
    """A router index holding the fleet's stream (never tailing a broker)."""
    use_group_kind(request.param, monkeypatch)
    index = RouterIndex("127.0.0.1:9", dynamo=True)
    codec = Codec()
    messages = fleet_stream(FLEET).messages
    for i in range(0, len(messages), 100):
        run_batch(messages[i : i + 100], codec, index.store, "g")
    return index


@pytest.fixture
def client(router: RouterIndex) -> TestClient:
    return TestClient(create_app(ServiceConfig(router=router, silent_after=WIDE, dynamo_api=True)))


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    return fleet_prompts(FLEET, count, seed)


def query(client: TestClient, tokens: list[int], **extra: Any) -> dict[str, Any]:
    r = client.post("/query", json={"token_ids": tokens, "model_name": MODEL, **extra})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def tree_from_dump(client: TestClient) -> tuple[Any, int]:
    """Dynamo's RadixTree holding kvledger's /dump (its device tier: what the tree keeps)."""
    dump = client.get("/dump").json()
    entry = dump[f"{MODEL}:default"]
    tree = dynamo.RadixTree()
    device = [e for e in entry["events"] if e["storage_tier"] == "device"]
    assert len(device) > 100
    for e in device:
        tree.apply_event(e["worker_id"], json.dumps(e["event"]).encode())
    return tree, entry["block_size"]


def test_dynamos_tree_fed_kvledgers_dump_scores_every_prompt_as_kvledger_does(
    client: TestClient,
) -> None:
    tree, block_size = tree_from_dump(client)
    hits = 0
    for tokens in prompts(300):
        locals_ = dynamo.compute_block_hash_for_seq(tokens, block_size)
        theirs = {
            str(w): {str(dp): n * block_size}
            for (w, dp), n in tree.find_matches(locals_).scores.items()
        }
        ours = query(client, tokens)
        assert ours["scores"] == theirs
        by_hash = client.post("/query_by_hash", json={"block_hashes": locals_, "model_name": MODEL})
        assert by_hash.json() == ours
        signed = [h - (1 << 64) if h >= 1 << 63 else h for h in locals_]  # as Dynamo's i64
        by_signed = client.post(
            "/query_by_hash", json={"block_hashes": signed, "model_name": MODEL}
        )
        assert by_signed.json() == ours
        hits += bool(theirs)
    assert hits > 100  # the prompts do hit


def test_scores_agree_with_v1_match_and_lower_tiers_continue_the_gpu_match(
    client: TestClient,
) -> None:
    lower = 0
    for tokens in prompts(200, seed=5):
        ours = query(client, tokens)
        held = client.post(
            "/v1/match", json={"model": MODEL, "group_idx": 0, "token_ids": tokens}
        ).json()["holders"]
        gpu = {
            str(int(h["instance"].rsplit("-", 1)[1])): {"0": h["matched_blocks"] * 32}
            for h in held
            if h["medium"] == "GPU" and h["matched_blocks"] > 0
        }
        assert ours["scores"] == gpu
        for wid, summary in ours["instances"].items():
            assert summary["gpu"] <= summary["cpu"] <= summary["disk"] == summary["longest_matched"]
            assert summary["dp"] == {"0": summary["gpu"]}
            assert (wid in ours["scores"]) == (summary["gpu"] > 0)
            # every tier's own run from the root is within what the tiers give together
            for h in held:
                if str(int(h["instance"].rsplit("-", 1)[1])) == wid:
                    assert h["matched_blocks"] * 32 <= summary["longest_matched"]
            lower += summary["cpu"] > summary["gpu"] or summary["disk"] > summary["cpu"]
    assert lower > 20  # lower tiers extend matches past the GPU's


def test_every_answer_is_recorded_with_what_each_instance_was_offered(
    router: RouterIndex,
) -> None:
    noted: list[tuple[Any, Any]] = []
    client = TestClient(
        create_app(
            ServiceConfig(
                router=router,
                silent_after=WIDE,
                dynamo_api=True,
                record_answer=lambda a, build: noted.append((a, build)),
            )
        )
    )
    offered = 0
    for tokens in prompts(40, seed=7):
        ours = query(client, tokens)
        locals_ = requests.local_hashes(tokens, 32, None)
        by_hash = client.post("/query_by_hash", json={"block_hashes": locals_,
                                                      "model_name": MODEL})  # fmt: skip
        assert by_hash.json() == ours
        for answered, build in noted[-2:]:
            assert (answered.model, answered.group_idx) == (MODEL, 0)
            rec = build()
            assert rec.prompt_blocks == len(tokens) // 32 == len(locals_)
            longest = max((s["longest_matched"] for s in ours["instances"].values()), default=0)
            assert rec.available_blocks == longest // 32
            assert rec.captured_blocks is None and rec.chosen_state is None
            # each offer names the instance behind its worker id, its blocks the answer's
            for o in rec.offered:
                summary = ours["instances"][str(int(o.instance.rsplit("-", 1)[1]))]
                field = {"GPU": "gpu", "CPU": "cpu", "STORAGE": "disk"}[o.medium]
                assert o.blocks * 32 == summary[field] and o.state == "live"
            offered += len(rec.offered)
    assert len(noted) == 80 and offered > 40
    # Where nothing is recorded, nothing is noted.
    quiet = TestClient(create_app(ServiceConfig(router=router, silent_after=WIDE, dynamo_api=True)))
    query(quiet, prompts(1)[0])
    assert len(noted) == 80


def test_every_block_keeps_dynamos_local_hash(router: RouterIndex) -> None:
    checked = 0
    for g in router.store.groups.values():
        for h in g.hashes():
            row = g.row(h)
            assert row is not None
            local = g.dynamo_local(h)
            tokens, size, partial = list(row[2]), row[3], row[4]
            if partial or size <= 0 or len(tokens) != size:
                assert local is None
                continue
            assert [local] == dynamo.compute_block_hash_for_seq(tokens, size)
            checked += 1
    assert checked > 1000


def test_lora_blocks_hash_with_their_adapter() -> None:
    for kind in (PureGroup, groups.Group):
        g = kind()
        g.enable_dynamo()
        g.add_row(b"\x01" * 8, None, 0, [5, 6, 7, 8], 4, False, "adapter-x", True)
        g.add_row(b"\x02" * 8, b"\x01" * 8, 4, [9, 10, 11, 12], 4, False, "adapter-x", True)
        g.add_row(b"\x03" * 8, None, 0, [5, 6, 7, 8], 4, False, None, True)
        g.hold(b"\x01" * 8, 0, 1)
        g.hold(b"\x02" * 8, 0, 1)
        g.hold(b"\x03" * 8, 1, 1)
        with_lora = dynamo.compute_block_hash_for_seq(list(range(5, 13)), 4, lora_name="adapter-x")
        assert g.dynamo_local(b"\x02" * 8) == with_lora[1]
        assert g.dynamo_levels(with_lora, 4) == [(0, 0b11)]
        plain = dynamo.compute_block_hash_for_seq([5, 6, 7, 8], 4)
        assert g.dynamo_levels(plain, 4) == [(1, 0b1)]
        g.set_meta(b"\x03" * 8, None, False)  # extra keys now: Dynamo's hash unknown
        assert g.dynamo_levels(plain, 4) == [] and g.dynamo_local(b"\x03" * 8) is None


def test_runs_go_on_down_the_tiers_per_slot_in_both_twins() -> None:
    """Blocks 0-4 of one chain: holder 0 (slot 0 GPU) has 0-1, holder 1 (slot 0 CPU) 2-3
    (and 0), holder 2 (slot 0 storage) 4; holder 3 (slot 1 GPU) has 1-4 but not 0;
    holder 4 is left out (-1), holder 5 has no slot."""
    tokens = list(range(20))
    locals_ = dynamo.compute_block_hash_for_seq(tokens, 4)
    held = {0: [0, 1], 1: [0, 2, 3], 2: [4], 3: [1, 2, 3, 4], 4: [0], 5: [0]}
    answers = []
    for kind in (PureGroup, groups.Group):
        g = kind()
        g.enable_dynamo()
        parent = None
        for i in range(5):
            key = bytes([i + 1]) * 8
            g.add_row(key, parent, 4 * i, tokens[4 * i : 4 * i + 4], 4, False, None, True)
            parent = key
        for hid, blocks in held.items():
            for i in blocks:
                g.hold(bytes([i + 1]) * 8, hid, 1)
        answers.append(g.dynamo_runs(locals_, 4, [0, 1, 2, 3, -1]))
        assert g.dynamo_runs(locals_, 8, [0, 1, 2, 3]) == []  # another block size
        assert g.dynamo_runs(locals_[1:], 4, [0, 1, 2, 3]) == []  # not from the root
        # The answer written from those runs, from hashes or from token ids packed as a
        # /query body is read (+ a partial block), in one call.
        slots = groups.dynamo_slots(kind)
        for slot_tier in [0, 1, 2, 3, -1]:
            slots.add_holder(slot_tier)
        slots.set_slot(0, 7, 0, 1_000)
        slots.set_slot(1, 8, 2, 1_000)
        packed = b"".join(t.to_bytes(4, "little") for t in [*tokens, 7, 7])
        written = g.dynamo_answer(locals_, 4, slots, 1_000)
        assert g.dynamo_answer_packed(packed, 4, dynamo_seed(), slots, 1_000) == written
        assert json.loads(written) == {
            "scores": {"7": {"0": 8}}, "frequencies": [],
            "instances": {"7": {"longest_matched": 20, "gpu": 8, "dp": {"0": 8}, "cpu": 16,
                                "disk": 20}},
        }  # fmt: skip
        none = b'{"scores":{},"frequencies":[],"instances":{}}'
        assert g.dynamo_answer(locals_, 4, slots, 1_001) == none  # seen before the cut
        assert g.dynamo_answer_packed(packed, 4, dynamo_seed("other"), slots, 0) == none
        assert g.dynamo_answer_packed(packed, 0, dynamo_seed(), slots, 0) == none
        assert g.dynamo_answer(locals_, -4, slots, 0) == none
        slots.set_seen(0, None)  # closed
        assert g.dynamo_answer(locals_, 4, slots, 0) == none
        with pytest.raises(IndexError):
            slots.set_slot(3, 9, 0, 0)
    assert answers[0] == [(0, 2, 4, 5)]  # slot 1's GPU run starts past block 0: none
    assert all(a == answers[0] for a in answers)


def test_answers_sum_a_workers_ranks_alike_in_both_twins() -> None:
    """Random runs over slots of a few workers and ranks (some repeated, some not live):
    the compiled and pure answers are the same bytes, and what Python's dicts make of the
    runs."""
    import random

    rng = random.Random(5)
    kinds = [PureGroup, groups.Group]
    for _ in range(200):
        workers = [(rng.randrange(4), rng.randrange(3), rng.choice([None, 5, 10]))
                   for _ in range(rng.randrange(1, 9))]  # fmt: skip
        cut = rng.choice([0, 6, 11])
        # holder 3 * slot + tier holds a prefix of this many blocks
        held = [rng.randrange(len(workers) + 1) for _ in range(3 * len(workers))]
        bodies = set()
        for kind in kinds:
            g, slots = kind(), groups.dynamo_slots(kind)
            g.enable_dynamo()
            tokens = list(range(4 * len(workers)))
            parent = None
            for i in range(len(workers)):
                key = (i + 1).to_bytes(8, "big")
                g.add_row(key, parent, 4 * i, tokens[4 * i : 4 * i + 4], 4, False, None, True)
                parent = key
            for slot, (wid, rank, seen) in enumerate(workers):
                slots.set_slot(slot, wid, rank, seen)
                for tier in range(3):
                    slots.add_holder(slot * 3 + tier)
                    for i in range(held[slot * 3 + tier]):
                        g.hold((i + 1).to_bytes(8, "big"), slot * 3 + tier, 1)
            locals_ = dynamo.compute_block_hash_for_seq(tokens, 4)
            bodies.add(g.dynamo_answer(locals_, 4, slots, cut))
        assert len(bodies) == 1, bodies
        got = json.loads(bodies.pop())
        assert set(got["scores"]) <= set(got["instances"]) <= {str(w) for w, _, _ in workers}
        for wid, s in got["instances"].items():
            assert s["longest_matched"] == s["disk"] >= s["cpu"] >= s["gpu"]
            assert s["gpu"] == max(s["dp"].values())
            assert got["scores"].get(wid, {}) == {r: t for r, t in s["dp"].items() if t}


def test_a_source_that_is_not_live_is_not_scored_nor_dumped(router: RouterIndex) -> None:
    client = TestClient(
        create_app(ServiceConfig(router=router, silent_after=WIDE, dynamo_api=True))
    )
    tokens = next(p for p in prompts(50) if query(client, p)["scores"])
    wid = next(iter(query(client, tokens)["scores"]))
    name = f"engine-{wid}"
    life = router.store.lives[name]
    router.store.lives[name] = SourceLife(life.model, life.epoch, life.last_seen,
                                          closed_at=datetime.now(UTC))  # fmt: skip
    assert wid not in query(client, tokens)["scores"]
    assert wid not in query(client, tokens)["instances"]
    events = client.get("/dump").json()[f"{MODEL}:default"]["events"]
    assert events and all(str(e["worker_id"]) != wid for e in events)


def test_refusals_have_dynamos_status_codes(client: TestClient) -> None:
    def post(path: str, body: Any) -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        return r.status_code, r.json()

    assert post("/query", {"token_ids": [1], "model_name": "nope"}) == (
        404, {"error": "no indexer for model=nope routing_group=default"},
    )  # fmt: skip
    status, body = post("/query", {"token_ids": [1], "model_name": MODEL, "routing_group": "x"})
    assert status == 404 and "routing_group=x" in body["error"]
    assert post("/query", b"{not json")[0] == 400
    assert post("/query", [1, 2])[0] == 422
    assert post("/query", {"model_name": MODEL})[0] == 422  # no token_ids
    assert post("/query", {"token_ids": "1 2", "model_name": MODEL})[0] == 422
    assert post("/query", {"token_ids": [-1], "model_name": MODEL})[0] == 422
    assert post("/query", {"token_ids": [1 << 32], "model_name": MODEL})[0] == 422
    assert post("/query", {"token_ids": [True], "model_name": MODEL})[0] == 422
    assert post("/query", {"token_ids": [1], "model_name": 7})[0] == 422
    assert post("/query_by_hash", {"block_hashes": [1 << 64], "model_name": MODEL})[0] == 422
    assert post("/query_by_hash", {"block_hashes": [-1], "model_name": MODEL})[0] == 200
    salted = {"block_hashes": [1], "model_name": MODEL, "cache_salt": "s"}
    assert post("/query_by_hash", salted)[0] == 400
    assert post("/query", {"token_ids": [1], "model_name": MODEL, "cache_salt": "s"})[0] == 400
    too_many = {"token_ids": [1] * (requests.MAX_TOKENS + 1), "model_name": MODEL}
    assert post("/query", too_many)[0] == 413
    huge = b'{"token_ids": [' + b"1," * (requests.MAX_BODY_BYTES // 2) + b'1], "model_name": "m"}'
    assert post("/query", huge)[0] == 413
    empty = post("/query", {"token_ids": [], "model_name": MODEL})
    assert empty == (200, {"scores": {}, "frequencies": [], "instances": {}})


def test_workers_registration_and_unregistration(client: TestClient) -> None:
    workers = client.get("/workers").json()
    assert {w["instance_id"] for w in workers} == {0, 1, 2, 3}
    w = next(w for w in workers if w["instance_id"] == 2)
    assert w["kvledger_source"] == "engine-2" and w["status"] == "active"
    assert (w["model_name"], w["routing_group"], w["block_size"]) == (MODEL, "default", 32)
    assert client.get("/workers", params={"model_name": "other"}).json() == []
    before = [query(client, p)["instances"].keys() for p in prompts(80)]
    assert any("3" in ids for ids in before)

    # A registration names a source by the id it has; it cannot re-key it (every client's
    # answers would change), nor take an id another source has.
    reg = {"instance_id": 3, "endpoint": "tcp://10.0.0.9:5557", "model_name": MODEL,
           "block_size": 32, "source": "engine-3"}  # fmt: skip
    assert client.post("/register", json=reg).status_code == 201
    for wid, source in ((42, "engine-3"), (2, "engine-new")):
        taken = client.post("/register", json=dict(reg, instance_id=wid, source=source))
        assert taken.status_code == 409, taken.json()
    ids = {w["kvledger_source"]: w["instance_id"] for w in client.get("/workers").json()}
    assert ids["engine-3"] == 3 and ids["engine-2"] == 2
    assert [query(client, p)["instances"].keys() for p in prompts(80)] == before
    # A source not seen yet takes the id it is registered with, until unregistered.
    ahead = dict(reg, instance_id=42, source="engine-new")
    assert client.post("/register", json=ahead).status_code == 201
    listed = [w for w in client.get("/workers").json() if w["instance_id"] == 42]
    assert [(w["kvledger_source"], w["status"]) for w in listed] == [("engine-new", "pending")]
    assert (
        client.post("/unregister", json={"instance_id": 42, "model_name": MODEL}).status_code == 200
    )
    again = dict(ahead, source="engine-newer")  # 42 is free again: the pin went with it
    assert client.post("/register", json=again).status_code == 201
    assert (
        client.post("/unregister", json={"instance_id": 42, "model_name": MODEL}).status_code == 200
    )

    unknown = {"instance_id": 77, "endpoint": "tcp://x:1", "model_name": MODEL, "block_size": 32}
    assert client.post("/register", json=unknown).status_code == 201
    pending = [w for w in client.get("/workers").json() if w["instance_id"] == 77]
    assert [w["status"] for w in pending] == ["pending"]
    wrong = dict(unknown, instance_id=78, block_size=16)
    assert client.post("/register", json=wrong).status_code == 409
    assert client.post("/register", json={"instance_id": 1}).status_code == 422

    out = {"instance_id": 77, "model_name": MODEL}
    assert client.post("/unregister", json=out).json() == {"status": "ok"}
    assert client.post("/unregister", json=out).status_code == 404
    assert 77 not in {w["instance_id"] for w in client.get("/workers").json()}


def test_the_stores_lives_note_every_change_for_the_slot_table() -> None:
    lives = store_module.Lives()
    life = SourceLife(MODEL, 1, datetime.now(UTC))
    lives["a"] = life
    lives.update({"b": life}, c=life)
    lives.setdefault("d", life)
    lives |= {"e": life}
    assert lives.drain() == {"a", "b", "c", "d", "e"} and lives.drain() == set()
    del lives["a"]
    lives.pop("b")
    lives.popitem()  # the last set: "e"
    assert lives.drain() == {"a", "b", "e"}
    lives.clear()
    assert lives.drain() == {"c", "d"} and not lives


def test_worker_ids_are_stable_and_distinct() -> None:
    w = dynamo_workers.Workers()
    w.see(["b-7", "a-7", "plain", "9"])
    assert w.id_of("a-7") == 7 and w.id_of("9") == 9
    assert w.id_of("b-7") == dynamo_workers.hashed_worker_id("b-7") != 7  # 7 was claimed first
    assert w.id_of("plain") == dynamo_workers.hashed_worker_id("plain") < 1 << 63
    assert w.pin("plain", 7) is not None  # neither re-keyed nor given another's id
    assert w.pin("new", 7) is not None and w.pin("a-7", 7) is None  # its own: kept
    assert w.pin("new", 70) is None and w.id_of("new") == 70
    w.unpin("new")
    assert w.id_of("new") == dynamo_workers.hashed_worker_id("new")  # its own again
    assert len(set(w.ids.values())) == len(w.ids) == len(w.names)


def test_a_relays_data_parallel_ranks_are_one_worker() -> None:
    w = dynamo_workers.Workers()
    w.see_sources(["engine-3-dp0", "engine-3-dp1", "engine-4"])
    assert w.worker_of("engine-3-dp1") == (3, 1) and w.worker_of("engine-3-dp0") == (3, 0)
    assert w.worker_of("engine-4") == (4, 0)
    assert w.worker_of("plain-dp2") == (dynamo_workers.hashed_worker_id("plain"), 2)


def test_no_registration_can_bloat_break_or_re_key_the_service(client: TestClient) -> None:
    """Attacks that once worked on /register: 8 MiB endpoints kept forever (450 MiB for 60,
    and a 505 MB /workers), a lone surrogate that made every /workers a 500, a chain of pins
    that made /register a 500 (RecursionError), bodies nested without end."""
    base = {"instance_id": 500, "endpoint": "tcp://x:1", "model_name": MODEL, "block_size": 32}
    huge = client.post("/register", json=dict(base, endpoint="x" * ((8 << 20) - 200)))
    assert huge.status_code in (413, 422), huge.status_code
    surrogate = b'{"instance_id": 501, "endpoint": "e", "model_name": "m\\ud800", "block_size": 32}'
    assert client.post("/register", content=surrogate).status_code == 400
    assert client.post("/unregister", content=surrogate).status_code == 400
    for deep in (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"[" * 100_000):
        assert client.post("/register", content=deep).status_code == 400
        assert client.post("/unregister", content=deep).status_code == 400
    statuses = set()
    for i in range(3000):  # each pinning the id the last one had, to a new source
        pin = dict(base, instance_id=1000 + i, source=f"chain-{i}")
        statuses.add(client.post("/register", json=dict(pin, source=f"chain-{i - 1}")).status_code)
        if i > api.MAX_REGISTRATIONS:
            break
    assert statuses <= {201, 409}, statuses
    full = client.post("/register", json=dict(base, instance_id=99_999, source=None))
    assert full.status_code == 409 and "unregister one first" in full.json()["error"]
    workers = client.get("/workers")
    assert workers.status_code == 200 and len(workers.content) < 4 << 20
    unknown = {"token_ids": [1], "model_name": MODEL, "routing_group": "nope"}
    for group in ("\u00b2", "\u0661"):  # digits to str.isdigit(), not group numbers
        answer = client.post("/query", json=dict(unknown, routing_group=group))
        assert (answer.status_code, answer.json()) == (
            404,
            {"error": f"no indexer for model={MODEL} routing_group={group}"},
        )


def test_dynamos_routes_are_in_the_openapi_document(client: TestClient) -> None:
    """Dynamo's routes were missing from /openapi.json, and /register's missing fields were
    learned one 422 at a time (issue 48's item 21)."""
    from tests.helpers.openapi import conformance

    document = client.get("/openapi.json").json()
    conforms = conformance(document)
    assert {"/query", "/query_by_hash", "/register", "/unregister", "/workers", "/dump"} <= set(
        document["paths"]
    )
    conforms(query(client, prompts(80)[0]), "DynamoScores")
    for worker in client.get("/workers").json():
        conforms(worker, "DynamoWorker")
    missing = client.post("/register", json={"model_name": MODEL})
    assert missing.status_code == 422
    assert "`instance_id`, `endpoint`, `block_size`" in missing.json()["error"]
    reg = {"instance_id": 901, "endpoint": "tcp://x:1", "model_name": MODEL, "block_size": 32}
    conforms(reg, "DynamoRegistration")
    done = client.post("/register", json=reg)
    assert done.status_code == 201
    conforms(done.json(), "DynamoStatus")
    plain = TestClient(create_app(ServiceConfig(router=RouterIndex("127.0.0.1:9", "t", "g"))))
    assert "/query" not in plain.get("/openapi.json").json()["paths"]  # no Dynamo API: none
