"""Routing decisions as data, through real Kafka and PostgreSQL: routers report decisions to
`kvledger serve --memory --decisions-topic`, which records what the index offered; the
consumer's recorder writes the records into kvledger.decisions exactly once; and the
funnel's views (kvledger.decision_outcomes, kvledger.decision_funnel) equal a brute-force
recomputation from the decisions and the index's own residency history. Dynamo's /query
answers are recorded too, with no chosen instance."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import defaultdict
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from confluent_kafka import Producer

from kvledger.cli import main as cli
from kvledger.consumer.db import connect
from kvledger.consumer.decision_records import DecisionRecorder
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.schemas.decisions import Answered, Record, decode
from kvledger.schemas.events import BlockRemoved, BlockStored, GroupSpec
from kvledger.serving.router.decisions import DecisionLog
from kvledger.serving.router.provisional import Provisional
from tests.helpers.consuming import by_partition, consume
from tests.helpers.procs import first_answer, free_port, spawn, until

pytestmark = pytest.mark.integration

MODEL, BLOCK = "m-decisions", 4


def chain(tag: int, n: int) -> list[bytes]:
    return [(tag * 1000 + j).to_bytes(8, "big") for j in range(n)]


P, R, Q = chain(1, 8), chain(2, 3), chain(3, 4)  # prompts by their hashes
P_TOKENS = list(range(100, 132))


def stored(hashes: list[bytes], start: int = 0, medium: str = "GPU",
           tokens: list[int] | None = None) -> BlockStored:  # fmt: skip
    parent = P[start - 1] if start else None
    toks = tokens or list(range(7000, 7000 + BLOCK * len(hashes)))
    return BlockStored(tuple(hashes), parent, tuple(toks), BLOCK, None, medium, None,
                       group_idx=0, token_start=start * BLOCK)  # fmt: skip


def engine(bootstrap: str, topic: str, name: str) -> KVEventPublisher:
    pub = KVEventPublisher(PublisherConfig(bootstrap, name, MODEL, topic=topic,
                                           heartbeat_interval_s=0))  # fmt: skip
    pub.announce_group_spec(GroupSpec(MODEL, 0, "full_attention", BLOCK, BLOCK))
    return pub


def decide(url: str, instance: str, hashes: list[bytes] | None = None, **body: Any) -> None:
    if hashes is not None:
        body["hashes"] = [h.hex() for h in hashes]
    r = httpx.post(f"{url}/v1/decisions", json={"model": MODEL, "instance": instance, **body},
                   timeout=10)  # fmt: skip
    assert r.status_code == 202, r.text


def recorded(recorder: DecisionRecorder, n: int) -> None:
    until(f"{n} decisions recorded",
          lambda: recorder.run_batch(0.2) >= 0 and recorder.recorded >= n)  # fmt: skip


def test_decisions_are_recorded_once_and_the_funnel_equals_a_recount(
    kafka_bootstrap, fresh_database, as_reader, make_topic, group_id, tmp_path, capsys
) -> None:
    topic = make_topic("decided")
    decisions = make_topic("decisions", partitions=2)
    a, b, c = (engine(kafka_bootstrap, topic, f"engine-{x}") for x in "abc")
    a.publish_events([stored(P, tokens=P_TOKENS)])  # a: all of P
    b.publish_events([stored(P[:4], tokens=P_TOKENS[:16])])  # b: P's first half
    c.publish_events([BlockStored(tuple(R), None, tuple(range(9000, 9012)), BLOCK, None,
                                  "CPU", None, group_idx=0, token_start=0)])  # fmt: skip
    for e in (a, b, c):
        e.flush()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the child writes it
    spawn([sys.executable, "-m", "kvledger", "serve", "--memory", "--database-url",
           as_reader(fresh_database), "--bootstrap", kafka_bootstrap, "--topic", topic,
           "--consumer-group", group_id, "--port", str(port), "--decisions-topic", decisions,
           "--silent-after", "3600", "--dynamo-api"], stdout=log, stderr=log)  # fmt: skip
    first_answer(f"{url}/healthz", "kvledger serve", timeout=60)
    until(
        "the index",
        lambda: len(
            httpx.post(
                f"{url}/v1/match", json={"model": MODEL, "hashes": [h.hex() for h in R]}
            ).json()["holders"]
        ),
    )

    decide(url, "engine-a", P, request_id="d1")  # all of it: then evicted before arrival
    decide(url, "engine-b", P, request_id="d2")  # half: chosen elsewhere
    decide(url, "engine-c", R, request_id="d3")  # all of R, on the CPU only
    decide(url, "engine-a", Q, request_id="d4")  # no holder
    # By tokens: the record names the engine's hashes of what engine-a holds (P), so its
    # delivered is known as d1's is.
    decide(url, "engine-a", token_ids=P_TOKENS, request_id="d5")
    # Asked as Dynamo's indexer: the answer is recorded, no choice with it.
    answer = httpx.post(f"{url}/query", json={"token_ids": P_TOKENS, "model_name": MODEL})
    assert answer.status_code == 200 and answer.json()["scores"], answer.text
    time.sleep(0.05)
    a.publish_events([BlockRemoved(tuple(P[5:]), "GPU", group_idx=0)])
    a.publish_events([stored(P[5:], start=5, tokens=P_TOKENS[20:])])  # stored again
    a.flush()
    until("the store again", lambda: httpx.post(f"{url}/v1/match", json={
        "model": MODEL, "hashes": [h.hex() for h in P]},
    ).json()["holders"][0]["matched_blocks"] == 8)  # fmt: skip
    time.sleep(0.05)
    decide(url, "engine-a", P, request_id="d6")  # after it: all delivered

    consume(kafka_bootstrap, fresh_database, topic, group_id)  # the index's history
    recorder = DecisionRecorder(fresh_database, kafka_bootstrap, decisions, group_id)
    assert recorder.open()
    recorded(recorder, 7)
    # Not a decision: kept with its bytes and why, and nothing else changes.
    garbage = Producer({"bootstrap.servers": kafka_bootstrap})
    garbage.produce(decisions, b'{"v": 2, "model": 7}', partition=0)
    garbage.flush(10)
    until("the rejected record", lambda: recorder.run_batch(0.2) >= 0 and recorder.rejected)
    recorder.close()

    # Exactly once: a recorder started again reads on from the stored offsets.
    again = DecisionRecorder(fresh_database, kafka_bootstrap, decisions, group_id)
    assert again.open()
    assert again.run_batch(1.0) == 0
    # and only one writes at a time
    other = DecisionRecorder(fresh_database, kafka_bootstrap, decisions, group_id)
    assert not other.open()
    again.close()

    with connect(fresh_database, autocommit=True) as conn:
        outcomes = {r[0]: r[1:] for r in conn.execute(
            "SELECT request_id, outcome, available_blocks, captured_blocks, delivered_blocks, "
            "captured_tier FROM kvledger.decision_outcomes").fetchall()}  # fmt: skip
        assert outcomes == {
            "d1": ("evicted_before_arrival", 8, 8, 5, "GPU"),
            "d2": ("chosen_elsewhere", 8, 4, 4, "GPU"),
            "d3": ("lower_tier_only", 3, 3, 3, "CPU"),
            "d4": ("no_holder", 0, 0, 0, None),
            "d5": ("evicted_before_arrival", 8, 8, 5, "GPU"),
            "d6": ("captured", 8, 8, 8, "GPU"),
            None: ("unreported", 8, None, None, None),  # the answer: a's 8 on its GPU
        }
        chosen, offered = conn.execute("SELECT chosen, offered FROM kvledger.decisions "
                                       "WHERE request_id IS NULL").fetchone()  # fmt: skip
        assert chosen is None
        assert sorted((o["instance"], o["blocks"]) for o in offered) == [
            ("engine-a", 8),
            ("engine-b", 4),
        ]
        raw, why = conn.execute("SELECT raw, reason FROM kvledger.rejected_decisions").fetchone()
        assert bytes(raw) == b'{"v": 2, "model": 7}' and "model" in why
        # A silent holder's decision, written as the recorder would.
        conn.execute(
            "INSERT INTO kvledger.decisions (decision_id, decided_at, model, group_idx, origin, "
            "chosen, chosen_state, block_size, prompt_blocks, available_blocks, "
            "captured_blocks, silent_blocks, offered, kafka_topic, kafka_partition, "
            "kafka_offset) VALUES (%s, now(), %s, 0, 'x', 'engine-b', 'live', 4, 8, 0, 0, 3, "
            "'[]', %s, 0, 99)", (uuid.uuid4(), MODEL, decisions),
        )  # fmt: skip
        assert_recount(conn)
    # `kvledger status` says the last hour's funnel.
    assert cli(["status", "--database-url", fresh_database, "--topic", topic,
                "--consumer-group", group_id]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "routing    7 decision(s) in the last hour: captured 89% of 35 blocks available" in out
    assert "delivered 25 " in out  # d1 5, d2 4, d3 3, d4 0, d5 5, d6 8 (the silent's unknown)
    assert "answers    1 with no choice reported (Dynamo's /query) in the last hour, 8 " in out


def assert_recount(conn: psycopg.Connection) -> None:
    """decision_outcomes and decision_funnel against a recount in Python from the rows of
    kvledger.decisions and kvledger.residency_history."""
    history = conn.execute(
        "SELECT model, group_idx, instance, block_hash, stored_at FROM kvledger.residency_history "
        "WHERE medium = 'GPU' AND ownership = ''").fetchall()  # fmt: skip
    stores: dict[tuple[str, int, str, bytes], list[Any]] = defaultdict(list)
    for model, group, instance, h, at in history:
        stores[(model, group, instance, bytes(h))].append(at)
    expected = {}
    for row in conn.execute(
        "SELECT decision_id, decided_at, model, group_idx, chosen, captured_hashes, "
        "available_blocks, captured_blocks, captured_tier, silent_blocks, prompt_blocks "
        "FROM kvledger.decisions"
    ).fetchall():
        did, at, model, group, chosen, hashes, available, captured, tier, silent, _ = row
        delivered = None
        if chosen is None:
            expected[did] = (None, "unreported")
            continue
        if hashes is not None:
            again = [i for i, h in enumerate(hashes)
                     if any(at < t <= at + timedelta(minutes=1)
                            for t in stores[(model, group, chosen, bytes(h))])]  # fmt: skip
            delivered = min(again) if again else captured
        if available == 0:
            outcome = "holder_silent" if silent else "no_holder"
        elif captured < available:
            outcome = "chosen_elsewhere"
        elif tier != "GPU":
            outcome = "lower_tier_only"
        elif delivered is not None and delivered < captured:
            outcome = "evicted_before_arrival"
        else:
            outcome = "captured"
        expected[did] = (delivered, outcome)
    outcomes = "SELECT decision_id, delivered_blocks, outcome FROM kvledger.decision_outcomes"
    got = {r[0]: (r[1], r[2]) for r in conn.execute(outcomes)}
    assert got == expected
    assert {o for _, o in expected.values()} >= {"holder_silent", "no_holder", "captured",
                                                "chosen_elsewhere", "lower_tier_only",
                                                "evicted_before_arrival", "unreported"}  # fmt: skip
    # The funnel: the same decisions summed per minute, model and chosen instance; the
    # answers with no choice counted apart.
    sums: dict[tuple[Any, ...], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 0])
    for did, at, model, chosen, available, captured, prompt in conn.execute(
        "SELECT decision_id, date_trunc('minute', decided_at), model, chosen, "
        "available_blocks, captured_blocks, prompt_blocks FROM kvledger.decisions"
    ).fetchall():
        s = sums[(at, model, chosen)]
        if chosen is None:
            s[5] += 1
            s[6] += available
            continue
        delivered = expected[did][0]
        s[0] += 1
        s[1] += prompt
        s[2] += available
        s[3] += captured
        s[4] += delivered or 0
    funnel = {(m, model, i): [n, p, a, c, d or 0, u, ua]
              for m, model, i, n, p, a, c, d, u, ua in conn.execute(
        "SELECT minute, model, instance, decisions, prompt_blocks, available_blocks, "
        "captured_blocks, delivered_blocks, unreported, unreported_available_blocks "
        "FROM kvledger.decision_funnel").fetchall()}  # fmt: skip
    assert funnel == dict(sums)


def test_answers_noted_as_the_service_stops_are_still_recorded(
    kafka_bootstrap: str, make_topic: Any, group_id: str
) -> None:
    """Answers wait for the log's thread, which records them every tenth of a second; the
    ones noted after its last pass (lookups answered while the server shuts down) must
    be recorded by the stop, not dropped with the queue."""
    topic = make_topic("decisions", partitions=1)
    log = DecisionLog(kafka_bootstrap, topic, Provisional(5.0))
    log.start()
    log._stop.set()  # the thread's last pass, held here before the stop proper
    assert log._thread is not None
    log._thread.join(10)
    for i in range(3):
        log.note_answer(
            Answered(MODEL, 0, request_id=f"r{i}"),
            lambda: Record(uuid.uuid4().hex, time.time(), BLOCK, 4, 2, 0, []),
        )
    log.stop()
    records = by_partition(kafka_bootstrap, topic, group_id, 3)[0]
    assert sorted(decode(r).request_id or "" for r in records) == ["r0", "r1", "r2"]


def test_poison_and_lying_records_are_refused_one_by_one_and_duplicates_change_nothing(
    kafka_bootstrap, fresh_database, make_topic, group_id, capsys
) -> None:
    """Records no honest replica writes, mixed with good ones on the decisions topic: NUL in
    a text, counts no index offered, times in 1970 and in the year 5135, one decision id
    twice in a batch and again in a later one. Each bad record is kept in
    kvledger.rejected_decisions with its reason and bytes, each good one is recorded once,
    and the recorder goes on past them (it once retried such a batch for ever)."""
    decisions = make_topic("decisions-poison", partitions=1)
    now = time.time()

    def wire(**changes: Any) -> bytes:
        offer = {"instance": "e-0", "medium": "GPU", "ownership": "", "blocks": 2,
                 "state": "live"}  # fmt: skip
        record = {
            "id": changes.pop("id", uuid.uuid4().hex), "at": changes.pop("at", now),
            "block_size": BLOCK, "prompt_blocks": 4, "available_blocks": 2, "silent_blocks": 0,
            "offered": [{**offer, **changes.pop("offer", {})}], "chosen_state": "live",
            "captured_blocks": 2, "captured_tier": "GPU", "available_tier": "GPU",
        }  # fmt: skip
        body = {"v": 2, "model": MODEL, "group_idx": 0, "origin": "o", "instance": "e-0",
                "kind": "hashes", "keys": [1, 2], "record": record}  # fmt: skip
        for k, v in changes.items():
            (record if k in record else body)[k] = v
        return json.dumps(body).encode()

    twice = uuid.uuid4().hex
    good = [wire(id=twice), wire(id=twice), wire()]  # the second: a duplicate in the batch
    bad = {
        "nul model": wire(model="m\u0000"),
        "nul offer": wire(offer={"instance": "e\u0000"}),
        "lying counts": wire(
            prompt_blocks=1, available_blocks=2**31 - 1, captured_blocks=2**31 - 1
        ),
        "1970": wire(at=0.0),
        "5135": wire(at=99_999_999_999.0),
    }
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for raw in [*good[:2], *bad.values(), good[2]]:
        producer.produce(decisions, raw)
    producer.flush(10)
    recorder = DecisionRecorder(fresh_database, kafka_bootstrap, decisions, group_id)
    assert recorder.open()
    try:
        until("every record read", lambda: recorder.run_batch(0.5) >= 0 and (
            recorder.recorded + recorder.rejected + recorder.duplicates == 8))  # fmt: skip
        producer.produce(decisions, wire(id=twice))  # the same decision in a later batch
        producer.flush(10)
        until("the repeat read", lambda: recorder.run_batch(0.5) >= 0 and (
            recorder.duplicates == 2))  # fmt: skip
    finally:
        recorder.close()
    assert (recorder.recorded, recorder.rejected, recorder.duplicates) == (2, 5, 2)
    # A record written while the recorder is down: `kvledger status` names it stalled.
    producer.produce(decisions, wire())
    producer.flush(10)
    events = make_topic("decided-status")
    common = ["status", "--database-url", fresh_database, "--bootstrap", kafka_bootstrap,
              "--topic", events, "--consumer-group", group_id]  # fmt: skip
    assert cli([*common, "--json"]) == 0, "behind, not yet stalled: said, not alarming"
    assert json.loads(capsys.readouterr().out)["recorder_behind"] == 1
    assert cli([*common, "--stalled-after", "0"]) == 1
    said = capsys.readouterr().out
    assert f"the decision recorder (on {decisions}) is 1 message(s) behind" in said, said
    with connect(fresh_database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT decision_id::text, count(*) FROM kvledger.decisions GROUP BY 1"
        ).fetchall()
        refused = conn.execute(
            "SELECT raw, reason FROM kvledger.rejected_decisions ORDER BY kafka_offset"
        ).fetchall()
    assert len(rows) == 2 and all(n == 1 for _, n in rows)
    assert str(uuid.UUID(twice)) in {r for r, _ in rows}
    assert [bytes(raw) for raw, _ in refused] == list(bad.values())
    reasons = [why for _, why in refused]
    assert "NUL" in reasons[0] and "NUL" in reasons[1], reasons
    assert "more blocks than the prompt" in reasons[2], reasons
    assert "from when it was written" in reasons[3] and "from when it was written" in reasons[4]
