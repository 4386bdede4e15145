"""The dashboard's routes from memory and the decision record's arithmetic (no services):
the page and its scripts are served with a content policy and no data, the memory fleet
counts every block the router holds, a bad window is a 400, and a record says what was
available, captured and silent on which tier."""

from __future__ import annotations

from datetime import timedelta

import pytest
from starlette.testclient import TestClient

from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.schemas.decisions import Answered, Decision, decode_record, encode
from kvledger.schemas.lookup import Holder
from kvledger.serving.lookup.dashboard import VENDOR
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.lookup.offer import MAX_CAPTURED_HASHES, answer_record, build_record
from kvledger.serving.router.index import RouterIndex
from tests.helpers.streams import fleet_stream


@pytest.fixture(scope="module")
def router() -> RouterIndex:
    router = RouterIndex("127.0.0.1:9", "t", "g")  # never started: filled here
    messages = fleet_stream(FleetConfig(instances=3, requests=40, seed=11)).messages
    for i in range(0, len(messages), 200):
        run_batch(messages[i : i + 200], Codec(), router.store, "g")
    return router


def test_the_page_holds_no_data_and_runs_only_its_own_scripts(router: RouterIndex) -> None:
    client = TestClient(create_app(ServiceConfig(router=router, token="t0k")))
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "<script>" not in page.text  # no inline script: the policy would refuse one
    script = client.get("/ui/dashboard.js")
    assert script.status_code == 200 and "textContent" in script.text
    assert "innerHTML" not in script.text
    chart = client.get("/ui/chart.umd.min.js")
    if (VENDOR / "chart.umd.min.js").exists():
        assert chart.status_code == 200 and len(chart.content) > 100_000
    else:
        assert chart.status_code == 503 and "vendor-ui" in chart.json()["error"]
    assert client.get("/v1/dashboard").status_code == 401


def test_the_memory_fleet_counts_every_block(router: RouterIndex) -> None:
    client = TestClient(create_app(ServiceConfig(router=router, silent_after=timedelta(days=9999))))
    body = client.get("/v1/dashboard?minutes=5").json()
    assert body["mode"] == "memory" and body["minutes"] == 5
    total = 0
    with router.lock:
        for g in router.store.groups.values():
            total += sum(len(g.held_by(hid)) for hid in range(len(router.store.holders)))
    assert sum(sum(s["held"].values()) for s in body["fleet"]) == total > 0
    assert {s["state"] for s in body["fleet"]} == {"live"}
    for bad in ("0", "1441", "x", "\u0661"):
        r = client.get(f"/v1/dashboard?minutes={bad}")
        assert r.status_code == 400 and "minutes" in r.json()["error"], bad
    # A second viewer within the refresh gets the same bytes, encoded once, as JSON.
    again = client.get("/v1/dashboard?minutes=5")
    assert again.headers["content-type"] == "application/json"
    assert again.json() == body and again.content == client.get("/v1/dashboard?minutes=5").content


def test_a_shared_answer_is_encoded_once_as_json_would_send_it() -> None:
    import json

    from kvledger.serving.lookup.dashboard import SharedAnswers, encoded

    answer = {"fleet": [{"source": "engine-é<b>", "held": {"GPU": 3}}], "mode": "memory"}
    shared: SharedAnswers[bytes] = SharedAnswers()
    made: list[bytes] = []
    first = shared.get(5, lambda: made.append(encoded(answer)) or made[-1])
    assert shared.get(5, lambda: made.append(b"") or made[-1]) is first and len(made) == 1
    assert json.loads(first) == answer and b", " not in first and "é".encode() in first
    with pytest.raises(ValueError):  # NaN is not JSON: refused, as Starlette refuses it
        encoded({"x": float("nan")})


def test_a_record_says_what_was_available_captured_and_silent() -> None:
    holders = [
        Holder("a", "CPU", "", 6, 24),
        Holder("b", "GPU", "", 6, 24),
        Holder("a", "GPU", "", 4, 16),
        Holder("s", "GPU", "", 7, 28, source_state="silent"),
    ]
    hashes = [bytes([i]) * 8 for i in range(8)]
    rec = build_record(holders, "a", "live", 4, 8, hashes)
    assert (rec.available_blocks, rec.available_tier) == (6, "GPU")  # b's, the faster tier
    assert (rec.captured_blocks, rec.captured_tier) == (6, "CPU")  # a's most, on its CPU
    assert rec.silent_blocks == 7
    assert rec.captured_hashes == [h.hex() for h in hashes[:6]]
    assert (rec.first_hash, rec.last_hash) == (hashes[0].hex(), hashes[-1].hex())
    assert [o.instance for o in rec.offered] == ["a", "b", "a", "s"]
    nobody = build_record([], "c", "live", 4, 3, None)
    assert (nobody.available_blocks, nobody.captured_blocks, nobody.captured_tier) == (0, 0, None)
    assert nobody.captured_hashes is None
    # On the wire and back, beside the hint the replicas read.
    decision = Decision("m", 0, "a", "hashes", (1, 2), "o", "r1")
    back, again = decode_record(encode(decision, rec))
    assert back == decision and again == rec
    assert decode_record(encode(decision)) == (decision, None)
    long = build_record([Holder("a", "GPU", "", 9000, 36000)], "a", "live", 4, 9000,
                        [i.to_bytes(8, "big") for i in range(9000)])  # fmt: skip
    assert len(long.captured_hashes or ()) == MAX_CAPTURED_HASHES


def test_an_answer_is_recorded_with_what_each_worker_was_offered_and_no_choice() -> None:
    # Dynamo's tiers count through the faster ones: worker 3 has 2 blocks on its GPU and 5
    # through its CPU; worker 9 (no instance known by that id) 1 on its GPU only.
    body = (b'{"scores":{"3":{"0":8},"9":{"0":4}},"frequencies":[],"instances":{'
            b'"3":{"longest_matched":20,"gpu":8,"dp":{"0":8},"cpu":20,"disk":20},'
            b'"9":{"longest_matched":4,"gpu":4,"dp":{"0":4},"cpu":4,"disk":4}}}')  # fmt: skip
    rec = answer_record(body, {3: "engine-3"}, 4, 7)
    assert [(o.instance, o.medium, o.blocks) for o in rec.offered] == [
        ("engine-3", "GPU", 2),
        ("engine-3", "CPU", 5),
        ("worker 9", "GPU", 1),
    ]
    assert (rec.available_blocks, rec.available_tier, rec.prompt_blocks) == (5, "CPU", 7)
    assert rec.captured_blocks is None and rec.chosen_state is None
    assert rec.captured_hashes is None and rec.first_hash is None
    empty = answer_record(b'{"scores":{},"frequencies":[],"instances":{}}', {}, 4, 3)
    assert (empty.available_blocks, empty.offered) == (0, [])
    # On the wire: version 3, never a decision to hold.
    answered = Answered("m", 1, "o", None)
    assert decode_record(encode(answered, rec)) == (answered, rec)
    with pytest.raises(ValueError, match="offered"):
        encode(answered)
    decision = Decision("m", 0, "a", "hashes", (1,), "o")
    chosen = build_record([Holder("a", "GPU", "", 1, 4)], "a", "live", 4, 1, None)
    for bad in (
        encode(answered, chosen),  # an answer with a choice's figures
        encode(decision, rec),  # a decision without them
        encode(answered, rec).replace(b'"instance":null', b'"instance":"a"'),
    ):
        with pytest.raises(ValueError):
            decode_record(bad)


@pytest.mark.parametrize("field", ["id", "at", "captured_hashes", "offered"])
def test_a_malformed_record_is_not_a_decision(field: str) -> None:
    rec = build_record([Holder("a", "GPU", "", 1, 4)], "a", "live", 4, 1, [b"\x01" * 8])
    raw = encode(Decision("m", 0, "a", "hashes", (1,), "o"), rec)
    import json

    wire = json.loads(raw)
    wire["record"][field] = {"id": "nope", "at": -1, "captured_hashes": ["zz"],
                             "offered": [{"instance": ""}]}[field]  # fmt: skip
    with pytest.raises(ValueError, match=field):
        decode_record(json.dumps(wire).encode())


def test_a_rate_limit_per_client_refills_and_stays_bounded() -> None:
    from kvledger.serving.lookup.ratelimit import RateLimit

    now = [0.0]
    limit = RateLimit(rate=2, burst=3, max_clients=2, clock=lambda: now[0])
    assert [limit.allow("a")[0] for _ in range(4)] == [True, True, True, False]
    assert limit.allow("a") == (False, 0.5)  # a token in half a second
    assert limit.allow("b")[0]  # each client its own bucket
    now[0] = 0.5
    assert limit.allow("a")[0] and not limit.allow("a")[0]
    limit.allow("c")
    assert len(limit) == 2  # the least recently seen client's bucket went
    with pytest.raises(ValueError):
        RateLimit(rate=0, burst=1)


def test_decision_reports_over_the_rate_are_429(
    router: RouterIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvledger.serving.lookup import http
    from kvledger.serving.router.provisional import Provisional

    monkeypatch.setattr(http, "DECISIONS_PER_CLIENT_S", 3)
    client = TestClient(create_app(ServiceConfig(router=router, provisional=Provisional(5))))
    codes = [client.post("/v1/decisions", json={"model": "nope", "instance": "x",
                                                "hashes": ["00"]}).status_code
             for _ in range(4)]  # fmt: skip
    assert codes == [400, 400, 400, 429]
    r = client.post("/v1/decisions", json={})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "decision reports a second" in r.json()["error"]
    documented = client.get("/openapi.json").json()["paths"]["/v1/decisions"]["post"]
    assert "Retry-After" in documented["responses"]["429"]["headers"]  # the answer is described


def test_dashboard_answers_are_shared_for_a_refresh() -> None:
    """Five tabs polling every second cost one computation per refresh, not five a second
    (what the dashboard's polling cost the consumer: bench/dashboard.py)."""
    import threading
    import time

    from kvledger.serving.lookup.dashboard import SharedAnswers

    now = [0.0]
    shared = SharedAnswers(ttl_s=5.0, keep=2, clock=lambda: now[0])
    made: list[int] = []

    def compute(minutes: int) -> dict[str, object]:
        made.append(minutes)
        return {"minutes": minutes, "n": len(made)}

    assert shared.get(60, lambda: compute(60)) == {"minutes": 60, "n": 1}
    now[0] = 4.9
    assert shared.get(60, lambda: compute(60))["n"] == 1  # shared
    assert shared.get(30, lambda: compute(30))["n"] == 2  # each window its own
    now[0] = 5.0
    assert shared.get(60, lambda: compute(60))["n"] == 3  # stale: computed again
    shared.get(10, lambda: compute(10))
    assert shared.get(30, lambda: compute(30))["n"] == 5  # only two windows are kept
    with pytest.raises(RuntimeError):
        shared.get(5, lambda: (_ for _ in ()).throw(RuntimeError("database down")))
    assert shared.get(5, lambda: compute(5))["minutes"] == 5  # a failure is not kept

    # Viewers asking while it is computed wait for that computation, not one each.
    slow = SharedAnswers(ttl_s=5.0, clock=lambda: now[0])
    started, release, calls = threading.Event(), threading.Event(), []

    def blocking() -> dict[str, object]:
        calls.append(1)
        started.set()
        release.wait(10)
        return {"n": len(calls)}

    answers: list[dict[str, object]] = []
    first = threading.Thread(target=lambda: answers.append(slow.get(60, blocking)))
    first.start()
    assert started.wait(10)
    others = [threading.Thread(target=lambda: answers.append(slow.get(60, blocking)))
              for _ in range(4)]  # fmt: skip
    for t in others:
        t.start()
    time.sleep(0.3)  # they are waiting by now
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert calls == [1] and answers == [{"n": 1}] * 5 and slow.computed == 1


def test_a_flood_of_windows_costs_a_computation_per_window_kept() -> None:
    """300 viewers each asking another window (the cache of 16 windows never hit) made 300
    computations: now each is cut from one of a few computed windows, and a viewer who asks
    while its window is computed again is given the answer before it."""
    import threading
    from datetime import UTC, datetime, timedelta

    from kvledger.serving.lookup.dashboard import MAX_MINUTES, WINDOWS, SharedAnswers, cut
    from kvledger.serving.lookup.dashboard import window_of as of

    now = datetime(2026, 12, 7, 12, 0, 30, tzinfo=UTC)

    def at(minutes_ago: float) -> str:
        return (now - timedelta(minutes=minutes_ago)).isoformat()

    made: list[int] = []

    def compute(window: int) -> dict[str, object]:
        made.append(window)
        points = [{"t": at(m), "blocks": m} for m in range(window + 1)]
        return {"now": now.isoformat(), "minutes": window, "fleet": [], "prefixes": [],
                "occupancy": points, "funnel": points, "timeline": points}  # fmt: skip

    shared: SharedAnswers[dict[str, object]] = SharedAnswers(keep=len(WINDOWS))
    for minutes in range(1, 301):
        answer = cut(shared.get(of(minutes), lambda m=minutes: compute(of(m))), minutes)
        assert answer["minutes"] == minutes
        ages = [p["blocks"] for p in answer["timeline"]]  # type: ignore[index, union-attr]
        assert ages == list(range(minutes + 1)) or ages == list(range(minutes)), minutes
    assert sorted(set(made)) == [w for w in WINDOWS if w <= 360] and len(made) == 3
    assert of(1) == WINDOWS[0] and of(MAX_MINUTES) == MAX_MINUTES
    assert all(of(m) >= m for m in range(1, MAX_MINUTES + 1))

    # Computed again (stale): a viewer meanwhile is answered at once with the one before.
    clock = [0.0]
    slow: SharedAnswers[dict[str, object]] = SharedAnswers(ttl_s=5.0, clock=lambda: clock[0])
    slow.get(60, lambda: {"n": 1})
    clock[0] = 6.0
    started, release = threading.Event(), threading.Event()

    def again() -> dict[str, object]:
        started.set()
        release.wait(10)
        return {"n": 2}

    worker = threading.Thread(target=lambda: slow.get(60, again))
    worker.start()
    assert started.wait(10)
    assert slow.get(60, again) == {"n": 1}  # not waiting for the computation under way
    release.set()
    worker.join(10)
    assert slow.get(60, again) == {"n": 2}
