"""The consumer against real Kafka and PostgreSQL: exact index, rejections, exactly-once."""

from __future__ import annotations

import json
import random
import signal
import struct
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kvledger.cli import main as cli
from kvledger.consumer.admin import dlq_summary
from kvledger.consumer.db import connect
from kvledger.consumer.verify import dump as full_dump
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import SINGLE_OBJECT_MAGIC, Codec
from kvledger.schemas.events import BlockStored, Envelope, GroupSpec
from kvledger.simulate_cmd import run_simulation
from tests.helpers.consuming import (
    by_partition,
    consume,
    consumer_process,
    wait_caught_up,
)
from tests.helpers.kafka import consume_all
from tests.helpers.reference_index import build, index_state

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def test_index_equals_reference_model(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("fleet", partitions=6)
    fleet = FleetConfig(instances=4, requests=120, seed=5, misconfigured_source=True)
    sim = run_simulation(kafka_bootstrap, topic, fleet, partitions=6, show_progress=False)
    assert sim.acked == sim.produced
    summary = consume(kafka_bootstrap, fresh_database, topic, group_id, batch=1500)
    assert summary.messages == sim.produced
    ref = build(by_partition(kafka_bootstrap, topic, group_id + "-read", sim.produced))
    with connect(fresh_database, autocommit=True) as conn:
        state = index_state(conn)
    assert state["blocks"] == ref.blocks
    assert state["residencies"] == ref.residencies()
    assert state["history"] == ref.history_multiset()
    assert state["status"] == ref.status
    assert state["rejected"] == ref.rejected
    # The fleet exercised what it should: partial tails re-announcing hashes (refcount > 1),
    # STORAGE residencies, placeholders of the sliding-window group, the misconfigured source.
    assert max(state["residencies"].values()) > 1
    assert any(k[4] == "STORAGE" and k[5] == "disk" for k in state["residencies"])
    assert any(row[4] for row in state["blocks"].values())  # partial rows
    assert any(row[3] == 0 for row in state["blocks"].values())  # placeholders
    assert ref.rejected["block_size_mismatch"] > 0
    # Running again is a no-op: offsets are stored with the index.
    again = consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert again.messages == 0


def _envelope(
    source: str, seq: int, event: object, epoch: int = 1_000, model: str = "m"
) -> Envelope:
    return Envelope(source, model, 0, epoch, seq, 1_700_000_000_000 + seq, event)  # type: ignore[arg-type]


def _stored(
    h: bytes, tokens: tuple[int, ...], size: int = 16, group: int = 0, **kw: object
) -> BlockStored:
    return BlockStored(
        (h,), None, tokens, size, None, "CPU", None, group_idx=group, token_start=0, **kw
    )  # type: ignore[arg-type]


def test_each_rejection_end_to_end_and_replay(
    kafka_bootstrap, fresh_database, make_topic, group_id, capsys
) -> None:
    # One partition: the first announcement of a group wins, so the order must be fixed.
    topic = make_topic("bad", partitions=1)
    codec = Codec()
    tokens = tuple(range(16))
    a, b = b"A" * 8, b"B" * 8
    spec = GroupSpec("m", 0, "full_attention", 16, 16)
    plan: list[tuple[str, bytes, str | None]] = [
        ("junk/0", b"not avro at all", "undecodable"),
        ("junk/0", SINGLE_OBJECT_MAGIC + struct.pack("<Q", 42) + b"\x00", "unknown_schema"),
        ("s1/0", codec.encode(_envelope("s1", 0, spec)), None),
        ("s1/0", codec.encode(_envelope("s1", 1, _stored(a, tokens))), None),
        ("s1/0", codec.encode(_envelope("s1", 1, _stored(a, tokens))), "duplicate"),
        (
            "s1/0",
            codec.encode(_envelope("s1", 2, _stored(b, tuple(range(32)), size=32))),
            "block_size_mismatch",
        ),
        (
            "s1/0",
            codec.encode(_envelope("s1", 3, _stored(b, tuple(range(10))))),
            "token_count_mismatch",
        ),
        (
            "s1/0",
            codec.encode(
                _envelope("s1", 4, BlockStored((b,), None, (), 0, None, "CPU", None, group_idx=0))
            ),
            "placeholder_for_full_attention",
        ),
        (
            "s1/0",
            codec.encode(_envelope("s1", 5, _stored(a, tuple(range(100, 116))))),
            "hash_conflict",
        ),
        ("s1/0", codec.encode(_envelope("s1", 0, _stored(b, tokens), epoch=999)), "stale_epoch"),
        (
            "s2/0",
            codec.encode(_envelope("s2", 0, GroupSpec("m", 0, "full_attention", 32, 16))),
            "spec_conflict",
        ),
        (
            "s3/5",
            codec.encode(_envelope("s3", 0, _stored(b"C" * 8, tokens, group=5))),
            "unknown_group",
        ),
    ]
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for key, value, _ in plan:
        producer.produce(topic, key=key.encode(), value=value)
    assert producer.flush(30) == 0

    summary = consume(kafka_bootstrap, fresh_database, topic, group_id)
    # A re-delivery is skipped but kept like a rejection (its audit row says "duplicate").
    expected_rejections = sorted(r for _, _, r in plan if r is not None)
    assert (
        sorted(r for r, n in summary.rejected_by_reason.items() for _ in range(n))
        == expected_rejections
    )
    assert summary.duplicates == 1

    with connect(fresh_database, autocommit=True) as conn:
        blocks = conn.execute("SELECT block_hash, token_ids FROM kvledger.blocks").fetchall()
        assert [(bytes(h), t) for h, t in blocks] == [(a, list(tokens))]  # first content kept
        stored = {
            r: bytes(raw)
            for r, raw in conn.execute(
                "SELECT reason, raw FROM kvledger.rejected_events"
            ).fetchall()
        }
        assert stored == {r: v for _, v, r in plan if r is not None}
        status = dict(
            conn.execute("SELECT status, count(*) FROM kvledger.events GROUP BY status").fetchall()
        )
        assert status == {"applied": 2, "rejected": len(expected_rejections) - 1, "duplicate": 1}

    dlq = consume_all(kafka_bootstrap, f"{topic}.dlq", group_id + "-dlq", len(expected_rejections))
    assert sorted(dict(m.headers())["kvledger.reason"].decode() for m in dlq) == expected_rejections
    for m in dlq:
        headers = dict(m.headers())
        assert headers["kvledger.topic"].decode() == topic
        assert int(headers["kvledger.offset"]) >= 0

    # An operator declares the missing group; replay applies exactly that event, once.
    assert (
        cli(
            [
                "groups",
                "declare",
                "--database-url",
                fresh_database,
                "--model",
                "m",
                "--group",
                "5",
                "--block-size",
                "16",
            ]
        )
        == 0
    )
    assert cli(["dlq", "replay", "--database-url", fresh_database]) == 0
    out = capsys.readouterr().out
    assert "declared group 5 of model m: full_attention, 16-token blocks" in out
    assert "GroupSpec(" not in out
    assert "replayed 1 of 8 pending rejected events" in out
    with connect(fresh_database, autocommit=True) as conn:
        summary = {row[0]: (row[1], row[2]) for row in dlq_summary(conn)}
    assert sum(p for p, _ in summary.values()) == len(expected_rejections) - 1
    assert sum(r for _, r in summary.values()) == 1
    assert summary["unknown_group"][1] == 1
    assert cli(["dlq", "list", "--database-url", fresh_database]) == 0
    assert "unknown_group" in capsys.readouterr().out
    assert cli(["dlq", "list", "--limit", "0", "--database-url", fresh_database]) == 0
    summary_only = capsys.readouterr().out
    assert "unknown_group" in summary_only and "offset" not in summary_only
    assert cli(["dlq", "list", "--json", "--database-url", fresh_database]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {r["reason"] for r in listed["summary"]} == set(expected_rejections)
    assert {r["kafka_topic"] for r in listed["rows"]} == {topic}
    assert cli(["groups", "list", "--json", "--database-url", fresh_database]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert {(g["group_idx"], g["origin"]) for g in groups} >= {(5, "declared")}
    assert cli(["dlq", "replay", "--database-url", fresh_database]) == 0
    assert "replayed 0 of 7 pending rejected events" in capsys.readouterr().out
    with connect(fresh_database, autocommit=True) as conn:
        hashes = {
            bytes(h) for (h,) in conn.execute("SELECT block_hash FROM kvledger.blocks").fetchall()
        }
        assert hashes == {a, b"C" * 8}
        refs = conn.execute(
            "SELECT instance, refcount FROM kvledger.residencies ORDER BY instance"
        ).fetchall()
        assert refs == [("s1", 1), ("s3", 1)]
        row = conn.execute(
            "SELECT status, reason FROM kvledger.events WHERE source = 's3'"
        ).fetchone()
        assert row == ("applied", "replayed")


def _produce_slowly(
    bootstrap: str, topic: str, fleet: FleetConfig, done: threading.Event, result: list[int]
) -> None:
    import kvledger.fleet as sim

    original = sim.SimulatedEngine.step

    def paced(self: sim.SimulatedEngine, summary: sim.FleetSummary) -> None:
        original(self, summary)
        time.sleep(0.004)

    sim.SimulatedEngine.step = paced  # type: ignore[method-assign]
    try:
        result.append(
            run_simulation(bootstrap, topic, fleet, partitions=6, show_progress=False).produced
        )
    finally:
        sim.SimulatedEngine.step = original  # type: ignore[method-assign]
        done.set()


def _reference_dump(
    kafka_bootstrap: str, database_url: str, topic: str, group: str
) -> dict[str, list[tuple[object, ...]]]:
    import uuid

    from kvledger.consumer.db import create_database, drop_database, migrate

    name = f"kvl_ref_{uuid.uuid4().hex[:10]}"
    url = create_database(database_url, name)
    try:
        migrate(url)
        consume(kafka_bootstrap, url, topic, group)
        with connect(url, autocommit=True) as conn:
            return full_dump(conn)
    finally:
        drop_database(database_url, name)


def test_exactly_once_under_kill_9(
    kafka_bootstrap, database_url, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("kill", partitions=6)
    fleet = FleetConfig(instances=3, requests=250, seed=8, misconfigured_source=True)
    done, produced = threading.Event(), []
    thread = threading.Thread(
        target=_produce_slowly, args=(kafka_bootstrap, topic, fleet, done, produced)
    )
    thread.start()
    rng = random.Random(2024)
    kills = 0
    while kills < 6 or not done.is_set():
        proc = consumer_process(kafka_bootstrap, fresh_database, topic, group_id, False, "c1")
        time.sleep(rng.uniform(0.8, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        assert kills < 40
    thread.join()
    final = consumer_process(kafka_bootstrap, fresh_database, topic, group_id, True, "c1")
    assert final.wait(timeout=180) == 0
    with connect(fresh_database, autocommit=True) as conn:
        interrupted = full_dump(conn)
    assert sum(interrupted["events"].values()) == produced[0]
    reference = _reference_dump(kafka_bootstrap, database_url, topic, group_id + "-ref")
    assert interrupted == reference


def test_rebalance_two_consumers_same_index(
    kafka_bootstrap, database_url, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("rebalance", partitions=6)
    fleet = FleetConfig(instances=4, requests=200, seed=12)
    done, produced = threading.Event(), []
    thread = threading.Thread(
        target=_produce_slowly, args=(kafka_bootstrap, topic, fleet, done, produced)
    )
    thread.start()
    first = consumer_process(
        kafka_bootstrap, fresh_database, topic, group_id, until_caught_up=False
    )
    time.sleep(2.0)
    second = consumer_process(
        kafka_bootstrap, fresh_database, topic, group_id, until_caught_up=False
    )
    time.sleep(3.0)
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0
    thread.join()
    wait_caught_up(kafka_bootstrap, fresh_database, topic, group_id)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    with connect(fresh_database, autocommit=True) as conn:
        shared = full_dump(conn)
    assert sum(shared["events"].values()) == produced[0]
    assert shared == _reference_dump(kafka_bootstrap, database_url, topic, group_id + "-ref")
