"""Faults against the real broker and database; every scenario ends with `kvledger verify`."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kvledger.cli import main as cli
from kvledger.consumer.db import connect, migrate
from kvledger.schemas.codec import SINGLE_OBJECT_MAGIC, Codec
from kvledger.schemas.events import BlockRemoved, BlockStored, Envelope, GroupSpec
from kvledger.schemas.topics import ensure_topic
from tests.helpers.consuming import consume, consumer_process, wait_caught_up
from tests.helpers.exactly_once import (
    assert_all_audited_and_verified,
    assert_exactly_once,
    produced,
    producer_process,
)
from tests.helpers.kafka import private_kafka
from tests.helpers.procs import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SERVICES = str(ROOT / "scripts" / "services")


def test_verify_detects_tampering_and_rebuild_repairs(
    kafka_bootstrap, fresh_database, make_topic, group_id, capsys
) -> None:
    topic = make_topic("verify", partitions=6)
    assert produced(producer_process(kafka_bootstrap, topic, 60, 100000)) > 0
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    args = [
        "--bootstrap",
        kafka_bootstrap,
        "--database-url",
        fresh_database,
        "--topic",
        topic,
        "--consumer-group",
        group_id,
    ]
    assert cli(["verify", *args]) == 0
    assert "verify: OK" in capsys.readouterr().out
    with connect(fresh_database, autocommit=True) as conn:
        conn.execute(
            "UPDATE kvledger.residencies SET refcount = refcount + 1 WHERE ctid = "
            "(SELECT ctid FROM kvledger.residencies LIMIT 1)"
        )
        conn.execute(
            "DELETE FROM kvledger.blocks WHERE ctid = (SELECT ctid FROM kvledger.blocks LIMIT 1)"
        )
    assert cli(["verify", *args]) == 1
    out = capsys.readouterr().out
    assert "residencies: 1 row(s) only in the live index, 1 only in the rebuild" in out
    assert "blocks: 0 row(s) only in the live index, 1 only in the rebuild" in out
    # Differences read as columns and values, hashes in hex, not Avro tuples.
    assert "    + rebuilt model=" in out and " block_hash=" in out and "b'" not in out
    assert cli(["verify", "--json", *args]) == 1  # the same report, for machines
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["rebuilt_messages"] > 0
    assert {(d["table"], d["only_live"], d["only_rebuilt"]) for d in report["differences"]} >= {
        ("residencies", 1, 1), ("blocks", 0, 1),
    }  # fmt: skip
    # Fed from a second topic too, the index cannot equal a rebuild from one: and verify
    # says why (it used to fail with no hint, issue 48's item 17).
    other = make_topic("verify-other", partitions=6)
    assert produced(producer_process(kafka_bootstrap, other, 5, 100000)) > 0
    consume(kafka_bootstrap, fresh_database, other, group_id)
    assert cli(["verify", *args]) == 1
    assert f"the index was also fed from {other} " in capsys.readouterr().out
    with connect(fresh_database, autocommit=True) as conn:
        conn.execute("DELETE FROM kvledger.consumer_offsets WHERE kafka_topic = %s", (other,))
        # Recorded routing decisions come from a topic of their own: a rebuild keeps them.
        conn.execute(
            "INSERT INTO kvledger.decisions (decision_id, decided_at, model, group_idx, origin, "
            "chosen, chosen_state, block_size, prompt_blocks, available_blocks, "
            "captured_blocks, offered, kafka_topic, kafka_partition, kafka_offset) VALUES "
            "(gen_random_uuid(), now(), 'm', 0, 'o', 'e', 'live', 4, 1, 1, 1, '[]', 'd', 0, 0)"
        )  # fmt: skip
        conn.execute(
            "INSERT INTO kvledger.consumer_offsets (consumer_group, kafka_topic, "
            "kafka_partition, next_offset) VALUES (%s, 'd', 0, 1)", (f"{group_id}:decisions",),
        )  # fmt: skip
    assert cli(["rebuild", *args]) == 2  # needs --yes
    assert cli(["rebuild", *args, "--yes"]) == 0
    assert cli(["verify", *args]) == 0  # the decisions topic is no other feed of the index
    with connect(fresh_database, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM kvledger.decisions").fetchone() == (1,)
        assert conn.execute(
            "SELECT next_offset FROM kvledger.consumer_offsets WHERE kafka_topic = 'd'"
        ).fetchone() == (1,)  # fmt: skip


def test_twenty_kills_under_steady_load(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("kill20", partitions=6)
    producer = producer_process(kafka_bootstrap, topic, requests=400, rate=1000)
    rng = random.Random(77)
    for _ in range(20):
        proc = consumer_process(kafka_bootstrap, fresh_database, topic, group_id, False, "k1")
        time.sleep(rng.uniform(0.5, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    count = produced(producer)
    final = consumer_process(kafka_bootstrap, fresh_database, topic, group_id, True, "k1")
    assert final.wait(timeout=300) == 0
    assert_all_audited_and_verified(kafka_bootstrap, fresh_database, topic, group_id, count)


def test_consumers_rebalancing_repeatedly(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("churn", partitions=6)
    producer = producer_process(kafka_bootstrap, topic, requests=250, rate=1000)
    steady = consumer_process(kafka_bootstrap, fresh_database, topic, group_id, False)
    for _ in range(4):
        extra = consumer_process(kafka_bootstrap, fresh_database, topic, group_id, False)
        time.sleep(2.5)
        extra.send_signal(signal.SIGTERM)
        assert extra.wait(timeout=60) == 0
    count = produced(producer)
    wait_caught_up(kafka_bootstrap, fresh_database, topic, group_id)
    steady.send_signal(signal.SIGTERM)
    assert steady.wait(timeout=60) == 0
    assert_all_audited_and_verified(kafka_bootstrap, fresh_database, topic, group_id, count)


def test_broker_restart_producer_blocks_and_resumes(fresh_database, tmp_path, group_id) -> None:
    with private_kafka(tmp_path / "state") as broker:
        bootstrap = broker.bootstrap
        topic = "kv-events"
        ensure_topic(AdminClient({"bootstrap.servers": bootstrap}), topic, 6)
        consumer = consumer_process(bootstrap, fresh_database, topic, group_id, False, "b1")
        producer = producer_process(bootstrap, topic, requests=250, rate=1000)
        time.sleep(4)
        broker.stop()
        time.sleep(3)
        broker.start()
        # The fleet's close() succeeds (everything acknowledged), and nothing is lost or twice.
        assert_exactly_once(bootstrap, fresh_database, topic, group_id, producer, consumer, 180)


def test_postgres_restart_consumer_retries(kafka_bootstrap, make_topic, group_id) -> None:
    # A state folder of its own (scripts/services lets the postgres user into it).
    state = tempfile.mkdtemp(prefix="kvledger-pgtest-")
    env = dict(os.environ, KVLEDGER_PG_PORT=str(free_port()), KVLEDGER_STATE_DIR=state)
    subprocess.run([SERVICES, "up", "postgres"], env=env, check=True)
    printed = subprocess.run([SERVICES, "env"], env=env, check=True, capture_output=True, text=True)
    db = next(
        line.partition("=")[2]
        for line in printed.stdout.splitlines()
        if line.startswith("export KVLEDGER_DATABASE_URL=")
    )
    try:
        migrate(db)
        topic = make_topic("pgrestart", partitions=6)
        producer = producer_process(kafka_bootstrap, topic, requests=250, rate=1000)
        consumer = consumer_process(kafka_bootstrap, db, topic, group_id, False, "p1")
        time.sleep(5)
        subprocess.run([SERVICES, "down", "postgres"], env=env, check=True)
        time.sleep(3)
        subprocess.run([SERVICES, "up", "postgres"], env=env, check=True)
        count = produced(producer)
        wait_caught_up(kafka_bootstrap, db, topic, group_id, timeout=180)
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(timeout=60) == 0
        assert_all_audited_and_verified(kafka_bootstrap, db, topic, group_id, count)
    finally:
        subprocess.run([SERVICES, "down", "postgres"], env=env, check=False)
        shutil.rmtree(state, ignore_errors=True)


def test_poison_input_is_rejected_and_the_consumer_keeps_going(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("poison", partitions=1)
    codec = Codec()
    rng = random.Random(13)

    def env(seq: int, event: object, epoch: int = 5_000) -> bytes:
        return codec.encode(Envelope("p", "m", 0, epoch, seq, 1_700_000_000_000 + seq, event))  # type: ignore[arg-type]

    def stored(h: bytes, tokens: tuple[int, ...], size: int) -> BlockStored:
        return BlockStored((h,), None, tokens, size, None, "CPU", None, group_idx=0, token_start=0)

    valid = env(7, stored(b"V" * 8, tuple(range(16)), 16))
    plan: list[tuple[bytes, str | None]] = [
        (env(0, GroupSpec("m", 0, "full_attention", 16, 16)), None),
        (rng.randbytes(64), "undecodable"),
        (valid[: len(valid) // 2], "undecodable"),
        (SINGLE_OBJECT_MAGIC + struct.pack("<Q", 7) + valid[10:], "unknown_schema"),
        (env(2, stored(b"T" * 8, tuple([1] * 300_000), 16)), "invalid_event"),
        (env(3, stored(b"N" * 8, tuple(range(16)), -16)), "block_size_mismatch"),
        (env(4, stored(b"A" * 8, tuple(range(16)), 1 << 30)), "block_size_mismatch"),
        (
            env(
                5,
                BlockStored(
                    (b"W" * 8, b"X" * 8), None, tuple(range(16)), 16, None, "CPU", None, group_idx=0
                ),
            ),
            "token_count_mismatch",
        ),
        (env(6, BlockRemoved((b"Z" * 8,), "CPU", 0)), None),  # removal before any store: a no-op
        (valid, None),
        (valid, "duplicate"),  # the same bytes delivered again
        (env(1, stored(b"O" * 8, tuple(range(16)), 16), epoch=4_000), "stale_epoch"),
        (env(8, stored(b"E" * 8, tuple(range(16)), 16)), None),  # still applied afterwards
    ]
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 2_000_000})
    for value, _ in plan:
        producer.produce(topic, key=b"p/0", value=value)
    assert producer.flush(30) == 0
    summary = consume(kafka_bootstrap, fresh_database, topic, group_id)
    expected = sorted(r for _, r in plan if r is not None)  # a duplicate is kept too
    assert sorted(r for r, n in summary.rejected_by_reason.items() for _ in range(n)) == expected
    assert summary.duplicates == 1
    with connect(fresh_database, autocommit=True) as conn:
        hashes = {
            bytes(h) for (h,) in conn.execute("SELECT block_hash FROM kvledger.blocks").fetchall()
        }
        noop = conn.execute(
            "SELECT noop_count, reason FROM kvledger.events WHERE event_type = 'BlockRemoved'"
        ).fetchone()
        rows = conn.execute("SELECT count(*) FROM kvledger.events").fetchone()
    assert hashes == {b"V" * 8, b"E" * 8}
    assert noop == (1, "noop_removal")
    assert rows == (len(plan),)
