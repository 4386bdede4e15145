"""Engines' lives through real Kafka and PostgreSQL: a publisher restarted with the same
source id, a source falling silent and coming back, a clean close, an old-contract
producer. Each ends with the index and its lookups checked."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Producer
from confluent_kafka.admin import ConfigResource
from starlette.testclient import TestClient

from kvledger.cli import main as cli
from kvledger.consumer.admin import list_sources
from kvledger.consumer.db import connect
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.schemas.codec import Codec, released_schemas
from kvledger.schemas.events import BlockStored, Envelope, GroupSpec, Heartbeat
from kvledger.schemas.topics import DEFAULT_RETENTION_MS, ensure_topic, message_key
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.lookup.http import ServiceConfig, create_app
from tests.helpers.consuming import consume
from tests.helpers.kafka import consume_all

pytestmark = pytest.mark.integration
MODEL = "m"
SPEC = GroupSpec(MODEL, 0, "full_attention", 4, 4)


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def block(i: int, medium: str, ownership: str | None = None) -> BlockStored:
    """Block i of a chain 1, 2, 3, ... (4 tokens each, parent i - 1)."""
    parent = h(i - 1) if i > 1 else None
    tokens = tuple(range(4 * (i - 1), 4 * i))
    return BlockStored(
        (h(i),), parent, tokens, 4, None, medium, None, group_idx=0, ownership=ownership,
        token_start=4 * (i - 1),
    )  # fmt: skip


def publisher(bootstrap: str, topic: str, source: str, **kw: object) -> KVEventPublisher:
    config = PublisherConfig(bootstrap, source, MODEL, topic=topic, **kw)  # type: ignore[arg-type]
    pub = KVEventPublisher(config)
    pub.announce_group_spec(SPEC)
    return pub


def media(url: str, source: str) -> dict[str, int]:
    with connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT medium, count(*) FROM kvledger.residencies WHERE instance = %s GROUP BY medium",
            (source,),
        ).fetchall()
    return dict(rows)


def test_a_restarted_publisher_loses_gpu_and_cpu_and_keeps_storage(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("restart", partitions=3)
    first = publisher(kafka_bootstrap, topic, "engine-r", heartbeat_interval_s=0)
    first.publish_events([block(1, "GPU"), block(2, "GPU"), block(1, "CPU")])
    first.publish_events([block(1, "STORAGE", "disk"), block(2, "STORAGE", "disk")])
    first.close(goodbye=False)  # a crash says nothing
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert media(fresh_database, "engine-r") == {"GPU": 2, "CPU": 1, "STORAGE": 2}

    second = publisher(kafka_bootstrap, topic, "engine-r", heartbeat_interval_s=0)
    second.close(goodbye=False)
    assert second.epoch > first.epoch
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert media(fresh_database, "engine-r") == {"STORAGE": 2}
    with connect(fresh_database, autocommit=True) as conn:
        restarts = conn.execute(
            "SELECT epoch, previous_epoch, ended_gpu, ended_cpu, ended_storage "
            "FROM kvledger.restarts WHERE source = 'engine-r'"
        ).fetchall()
        reasons = conn.execute(
            "SELECT medium, removed_by, count(*) FROM kvledger.residency_history "
            "WHERE instance = 'engine-r' GROUP BY medium, removed_by ORDER BY medium"
        ).fetchall()
        holders = PrefixIndex(conn).match(MODEL, 0, [h(1), h(2)])
    assert restarts == [(second.epoch, first.epoch, 2, 1, 0)]
    assert reasons == [("CPU", "restart", 1), ("GPU", "restart", 2), ("STORAGE", None, 2)]
    assert {(x.medium, x.matched_blocks) for x in holders} == {("STORAGE", 2)}


def test_a_silent_source_leaves_the_answers_and_comes_back(
    kafka_bootstrap, fresh_database, as_reader, make_topic, group_id
) -> None:
    topic = make_topic("silent", partitions=1)
    quiet = publisher(kafka_bootstrap, topic, "engine-q", heartbeat_interval_s=0)
    beating = publisher(kafka_bootstrap, topic, "engine-b", heartbeat_interval_s=0.5)
    quiet.publish_events([block(1, "CPU")])
    beating.publish_events([block(1, "CPU")])
    quiet.flush()
    beating.flush()
    window = timedelta(seconds=4)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    with connect(fresh_database, autocommit=True) as conn:
        index = PrefixIndex(conn)
        assert {x.instance for x in index.match(MODEL, 0, [h(1)], silent_after=window)} == {
            "engine-q", "engine-b",
        }  # fmt: skip
    time.sleep(5)  # engine-q says nothing; engine-b's heartbeats keep it live
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    with connect(fresh_database, autocommit=True) as conn:
        index = PrefixIndex(conn)
        live = index.match(MODEL, 0, [h(1)], silent_after=window)
        every = index.match(MODEL, 0, [h(1)], include_silent=True, silent_after=window)
        states = {s.source: s.state for s in list_sources(conn, window)}
    assert {x.instance for x in live} == {"engine-b"}
    assert {(x.instance, x.source_state) for x in every} == {
        ("engine-q", "silent"), ("engine-b", "live"),
    }  # fmt: skip
    assert states == {"engine-q": "silent", "engine-b": "live"}
    with TestClient(create_app(ServiceConfig(as_reader(fresh_database), 2, window))) as client:
        answer = client.post("/v1/match", json={"model": MODEL, "hashes": [h(1).hex()]}).json()
    assert [x["instance"] for x in answer["holders"]] == ["engine-b"]
    assert [(x["instance"], x["source_state"]) for x in answer["left_out"]] == [
        ("engine-q", "silent")
    ]
    quiet.publish_events([block(2, "CPU")])  # back
    quiet.close(goodbye=False)
    beating.close(goodbye=False)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    with connect(fresh_database, autocommit=True) as conn:
        back = PrefixIndex(conn).match(MODEL, 0, [h(1), h(2)], silent_after=window)
        beats = conn.execute(
            "SELECT count(*) FROM kvledger.events WHERE event_type = 'Heartbeat' "
            "AND source = 'engine-b' AND status = 'applied'"
        ).fetchone()
    assert {(x.instance, x.matched_blocks) for x in back} == {("engine-q", 2), ("engine-b", 1)}
    assert beats is not None and beats[0] >= 2


def test_an_engines_load_reaches_the_sources_and_the_sql_lookups(
    kafka_bootstrap, fresh_database, as_reader, make_topic, group_id, capsys
) -> None:
    """A heartbeat's load (as a relay with --engine-metrics-url sends it) through Kafka into
    PostgreSQL: `kvledger sources` shows it, the SQL service's /v1/match answers it when
    asked, and the engine's goodbye ends it."""
    topic = make_topic("load", partitions=1)
    busy = publisher(kafka_bootstrap, topic, "engine-busy", heartbeat_interval_s=0)
    mute = publisher(kafka_bootstrap, topic, "engine-mute", heartbeat_interval_s=0)
    busy.publish_events([block(1, "GPU"), Heartbeat(0, 1000, 3, 2)])
    mute.publish_events([block(1, "GPU"), Heartbeat(0, 1000)])  # its relay reads no metrics
    busy.flush()
    mute.flush()
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert cli(["sources", "--database-url", fresh_database, "--json"]) == 0
    shown = {s["source"]: s for s in json.loads(capsys.readouterr().out)}
    assert (shown["engine-busy"]["requests_running"], shown["engine-busy"]["requests_waiting"]) == (
        3, 2,
    )  # fmt: skip
    assert shown["engine-mute"]["load_at"] is None
    assert cli(["sources", "--database-url", fresh_database]) == 0
    table = capsys.readouterr().out
    assert "3/2" in table and "load: requests the engine was running/waiting" in table
    body = {"model": MODEL, "hashes": [h(1).hex()], "load": True}
    with TestClient(create_app(ServiceConfig(as_reader(fresh_database), 2))) as client:
        answer = client.post("/v1/match", json=body).json()
        plain = client.post("/v1/match", json={**body, "load": False}).json()
    assert list(answer["load"]) == ["engine-busy"]
    assert (answer["load"]["engine-busy"]["running"], answer["load"]["engine-busy"]["waiting"]) == (
        3, 2,
    )  # fmt: skip
    assert 0 <= answer["load"]["engine-busy"]["age_s"] < 60 and "load" not in plain
    busy.close()  # a goodbye: the engine and its load are gone
    mute.close(goodbye=False)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    with connect(fresh_database, autocommit=True) as conn:
        assert PrefixIndex(conn).loads(MODEL) == []
        row = conn.execute(
            "SELECT requests_running, requests_waiting, load_at FROM kvledger.sources "
            "WHERE source = 'engine-busy'"
        ).fetchone()
    assert row == (None, None, None)


def test_a_clean_close_says_goodbye(
    kafka_bootstrap, fresh_database, make_topic, group_id, capsys
) -> None:
    topic = make_topic("goodbye", partitions=3)
    pub = publisher(kafka_bootstrap, topic, "engine-g", heartbeat_interval_s=0)
    pub.publish_events([block(1, "GPU"), block(1, "CPU"), block(1, "STORAGE", "disk")])
    pub.close()
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert media(fresh_database, "engine-g") == {"STORAGE": 1}
    with connect(fresh_database, autocommit=True) as conn:
        closed = conn.execute(
            "SELECT kind, ended_gpu, ended_cpu, ended_storage FROM kvledger.lifecycle_events"
        ).fetchall()
        reasons = conn.execute(
            "SELECT DISTINCT removed_by FROM kvledger.residency_history "
            "WHERE removed_by IS NOT NULL"
        ).fetchall()
        everyone = PrefixIndex(conn).match(MODEL, 0, [h(1)], include_silent=True)
        routed = PrefixIndex(conn).match(MODEL, 0, [h(1)])
    assert closed == [("closed", 1, 1, 0)] and reasons == [("closed",)]
    assert [(x.medium, x.source_state) for x in everyone] == [("STORAGE", "closed")]
    assert routed == []
    assert cli(["sources", "--database-url", fresh_database, "--json"]) == 0
    [shown] = json.loads(capsys.readouterr().out)
    assert (shown["source"], shown["state"], shown["held"]["STORAGE"]) == ("engine-g", "closed", 1)


def test_an_old_contract_producer_applies_as_before(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("oldcontract", partitions=1)
    old = Codec(schema_json=released_schemas()[0])
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    events = [SPEC, block(1, "CPU"), block(2, "CPU")]
    for seq, event in enumerate(events):
        env = Envelope("engine-o", MODEL, 0, 1, seq, int(time.time() * 1000), event)
        producer.produce(topic, old.encode(env), message_key("engine-o", 0))
    assert producer.flush(30) == 0
    summary = consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert (summary.applied, summary.rejected) == (3, 0)
    assert media(fresh_database, "engine-o") == {"CPU": 2}
    with connect(fresh_database, autocommit=True) as conn:
        holders = PrefixIndex(conn).match(MODEL, 0, [h(1), h(2)])
    assert [(x.instance, x.matched_blocks) for x in holders] == [("engine-o", 2)]


def test_a_topic_kvledger_creates_stamps_records_with_the_broker_clock(
    kafka_bootstrap, kafka_admin, fresh_database, group_id
) -> None:
    topic = f"logtime-{group_id}"
    ensure_topic(kafka_admin, topic, 1)
    try:
        # and keeps its records the documented 7 days, whatever the broker's default
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
        configs = kafka_admin.describe_configs([resource])[resource].result(timeout=30)
        assert configs["retention.ms"].value == str(DEFAULT_RETENTION_MS) == "604800000"
        pub = publisher(kafka_bootstrap, topic, "engine-t", heartbeat_interval_s=0)
        pub.close(goodbye=False)
        [record] = consume_all(kafka_bootstrap, topic, group_id + "-read", 1)
        kind, stamp = record.timestamp()
        assert kind == TIMESTAMP_LOG_APPEND_TIME
        consume(kafka_bootstrap, fresh_database, topic, group_id)
        with connect(fresh_database, autocommit=True) as conn:
            row = conn.execute(
                "SELECT last_seen FROM kvledger.sources WHERE source = 'engine-t'"
            ).fetchone()
        assert row is not None and row[0].timestamp() * 1000 == stamp
    finally:
        kafka_admin.delete_topics([topic, f"{topic}.dlq"])
