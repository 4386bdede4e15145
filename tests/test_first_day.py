"""What a newcomer meets first, against the real services: a database never migrated, a
migration that says what it did, a source id reused for another model, a broker that does
not answer. Each answer is one clear line (or a 503 with its reason), never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer
from starlette.testclient import TestClient

from kvledger.cli import main as cli
from kvledger.consumer.db import SCHEMA_MISSING, create_database, drop_database
from kvledger.schemas.events import GroupSpec
from kvledger.serving.lookup.http import ServiceConfig, create_app
from tests.helpers.consuming import consume
from tests.helpers.procs import free_port
from tests.helpers.streams import Stream, removed, spec, stored

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_database(database_url: str) -> Iterator[str]:
    """A database kvledger migrate never ran on."""
    name = f"kvl_empty_{uuid.uuid4().hex[:10]}"
    url = create_database(database_url, name)
    yield url
    drop_database(database_url, name)


def test_a_database_never_migrated_says_run_migrate(
    empty_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = (
        ["sources"], ["lookup", "--model", "m", "--token-ids", "1,2"], ["dlq", "list"],
        ["groups", "list"],
    )  # fmt: skip
    for argv in commands:
        assert cli([*argv, "--database-url", empty_database]) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and SCHEMA_MISSING in err, (argv, err)
    # The SQL-backed service starts anyway (containers may start it before the migration)
    # and answers every lookup 503 with the reason until the schema is there.
    with TestClient(create_app(ServiceConfig(empty_database, pool_size=1))) as client:
        for response in (
            client.get("/healthz"),
            client.post("/v1/match", json={"model": "m", "token_ids": [1, 2]}),
            client.get(f"/v1/blocks/{'ab' * 8}"),
        ):
            assert response.status_code == 503, response.text
            assert response.json() == {"error": SCHEMA_MISSING}
            assert response.headers["retry-after"] == "30"
        # Migrated: the role check it could not make runs now, and refuses a writer.
        assert cli(["migrate", "--database-url", empty_database]) == 0
        assert "migrated from revision (none) to " in capsys.readouterr().out
        refused = client.get("/healthz")
        assert refused.status_code == 503 and "can write to the index" in refused.json()["error"]
    assert cli(["migrate", "--database-url", empty_database]) == 0
    again = capsys.readouterr().out
    assert "already at revision" in again and "nothing to do" in again


def test_a_source_that_changes_model_shows_in_sources(
    fresh_database: str, kafka_bootstrap: str, make_topic, group_id: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    topic = make_topic("model-change", partitions=1)
    stream = Stream(topic)
    stream.send("engine-x", spec(0))
    stream.send("engine-x", stored([1, 2]))
    stream.send("engine-x", GroupSpec("llama-other", 0, "full_attention", 4, 4),
                model="llama-other")  # fmt: skip
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for m in stream.messages:
        producer.produce(topic, value=m.value, key=m.key, partition=0)
    assert producer.flush(30) == 0
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert cli(["sources", "--database-url", fresh_database]) == 0
    out = capsys.readouterr().out
    assert "llama-other (was m)" in out
    assert "warning: source engine-x changed model from m to llama-other" in out
    assert cli(["sources", "--database-url", fresh_database, "--json"]) == 0
    assert '"previous_model": "m"' in capsys.readouterr().out


def _run(argv: list[str], timeout: float = 60) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvledger", *argv], capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    return done.returncode, done.stderr, time.monotonic() - start


def test_an_unreachable_broker_is_one_line_within_the_startup_timeout() -> None:
    """Nothing listens on the port: the command fails within its 10 s start-up timeout
    and prints a handful of lines, librdkafka's own logged once per distinct error."""
    bootstrap = f"127.0.0.1:{free_port()}"
    rc, err, seconds = _run(["simulate", "--bootstrap", bootstrap, "--instances", "1"])
    assert rc == 1 and seconds < 20, (seconds, err)
    lines = err.strip().splitlines()
    assert lines[-1].startswith("kvledger simulate: ") and "Traceback" not in err
    assert len(lines) <= 6, err


def test_verify_with_an_unreachable_broker_ends_and_leaves_no_scratch_database(
    fresh_database: str, database_url: str
) -> None:
    """It waited for the broker for ever, and each killed run left a scratch database."""
    import sqlalchemy as sa

    from kvledger.consumer.db import connect

    live = sa.engine.make_url(fresh_database).database
    with connect(fresh_database, autocommit=True) as conn:  # an index that has read a log
        conn.execute(
            "INSERT INTO kvledger.consumer_offsets (consumer_group, kafka_topic, "
            "kafka_partition, next_offset) VALUES ('kvledger-index', 'kv-events', 0, 5)"
        )
    bootstrap = f"127.0.0.1:{free_port()}"
    rc, err, seconds = _run(["verify", "--bootstrap", bootstrap, "--database-url", fresh_database])
    assert rc == 1 and seconds < 20, (seconds, err)
    assert err.strip().splitlines()[-1].startswith("kvledger verify: Kafka: no broker answered")
    with connect(database_url, autocommit=True) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (f"{live}_verify_%",)
        ).fetchall()
    assert left == []


def test_ctrl_c_stops_a_relay_that_waits_for_its_broker() -> None:
    """SIGINT while the relay first looks for an unreachable broker ends it at once."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger", "relay", "--endpoint", f"tcp://127.0.0.1:{free_port()}",
         "--source", "relay-ctrl-c", "--model", "m", "--bootstrap", f"127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_RELAY_")},
    )  # fmt: skip
    try:
        time.sleep(3)  # inside its first topic check
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert time.monotonic() - start < 10, err
        assert proc.returncode in (0, 130) and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_records_deleted_before_the_consumer_read_them_are_recorded_and_acted_on(
    fresh_database: str, kafka_bootstrap: str, make_topic, group_id: str,
    kafka_admin, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The consumer was away while retention deleted records it had not read (engine-0's
    removal of blocks 1-5): it records the loss (a row of kvledger.log_losses, an error,
    kvledger_log_records_lost_total), ends the residencies of the streams on that partition
    (1-5 are no longer claimed), and goes on from the log's start (6-8 are held). A router
    whose position falls out of the log stops, saying why, instead of skipping."""
    from confluent_kafka import TopicPartition

    from kvledger.consumer import metrics
    from kvledger.consumer.db import connect
    from kvledger.serving.router.index import RouterIndex

    topic = make_topic("deleted", partitions=1)
    stream = Stream(topic)
    stream.send("engine-0", spec(0))
    stream.send("engine-0", stored([1, 2, 3, 4, 5]))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(messages: list) -> None:
        for m in messages:
            producer.produce(topic, value=m.value, key=m.key, partition=0)
        assert producer.flush(30) == 0

    def held() -> list[bytes]:
        with connect(fresh_database, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT block_hash FROM kvledger.residencies WHERE instance = 'engine-0' "
                "ORDER BY block_hash"
            ).fetchall()
        return [bytes(r[0]) for r in rows]

    produce(stream.messages)
    consume(kafka_bootstrap, fresh_database, topic, group_id)  # caught up at offset 2
    assert len(held()) == 5
    router = RouterIndex(kafka_bootstrap, topic, group_id)
    with connect(fresh_database) as conn:
        router.bootstrap(conn)  # at offset 2, as the consumer
    stream.send("engine-0", removed([1, 2, 3, 4, 5]))
    stream.send("engine-0", stored([6, 7, 8]))
    produce(stream.messages[2:])
    kafka_admin.delete_records([TopicPartition(topic, 0, 3)])[
        TopicPartition(topic, 0, 3)
    ].result(30)  # fmt: skip
    with caplog.at_level("ERROR", logger="kvledger.consumer.service"):
        consume(kafka_bootstrap, fresh_database, topic, group_id)
    said = [r.getMessage() for r in caplog.records if "deleted from the log" in r.getMessage()]
    assert said == [
        f"{topic}[0]: 1 record(s), offsets 2..2, were deleted from the log before this index "
        "read them: the 5 residencies of the streams on that partition are ended (sources: "
        "engine-0), as a lost gap ends them, and reading goes on at 3"
    ]
    assert metrics.RECORDS_LOST.labels(topic, "0")._value.get() == 1
    assert held() == [h.to_bytes(8, "big") for h in (6, 7, 8)]  # the truth
    with connect(fresh_database, autocommit=True) as conn:
        losses = conn.execute(
            "SELECT consumer_group, kafka_partition, first_lost_offset, last_lost_offset, "
            "ended_residencies, sources FROM kvledger.log_losses"
        ).fetchall()
        closed = conn.execute(
            "SELECT count(*) FROM kvledger.residency_history WHERE removed_by = 'cleared'"
        ).fetchone()
    assert losses == [(group_id, 0, 2, 2, 5, ["engine-0"])] and closed == (5,)
    capsys.readouterr()
    assert cli(["sources", "--database-url", fresh_database]) == 0
    warned = capsys.readouterr().err
    assert f"{topic}[0] lost offsets 2..2 before the index read them" in warned
    assert "5 residencies ended (engine-0)" in warned
    consume(kafka_bootstrap, fresh_database, topic, group_id)  # again: nothing more lost
    assert held() == [h.to_bytes(8, "big") for h in (6, 7, 8)]
    from kvledger.consumer.verify import verify

    checked = verify(kafka_bootstrap, fresh_database, topic, group_id)
    assert checked.log_starts == {0: 3}  # verify says the log no longer holds offsets 0-2

    router.start()  # its snapshot's offset (2) is no longer in the log
    try:
        deadline = time.monotonic() + 30
        while router.position().error is None:
            assert time.monotonic() < deadline, "the router skipped what was deleted"
            time.sleep(0.1)
        assert "records were deleted from the log before this router read them" in (
            router.position().error or ""
        )
    finally:
        router.stop()


def test_a_mistyped_topic_is_refused_not_consumed_as_empty(
    kafka_bootstrap: str, fresh_database: str, make_topic, capsys: pytest.CaptureFixture[str]
) -> None:
    """`consume --until-caught-up --topic <typo>` exited 0 having read nothing."""
    real = make_topic("kv-events-typo")
    typo = real.replace("kv-events-typo", "kv-evnets-typo")
    argv = ["consume", "--until-caught-up", "--bootstrap", kafka_bootstrap,
            "--database-url", fresh_database, "--topic"]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        cli([*argv, typo])
    said = str(refused.value.code)
    assert f"topic {typo!r} does not exist" in said and f"did you mean {real!r}" in said
    group, dlq = f"g-{uuid.uuid4().hex[:8]}", make_topic("kv-events-typo-dlq")
    assert cli([*argv, real, "--consumer-group", group, "--dlq-topic", dlq]) == 0
    assert "consumed 0 messages" in capsys.readouterr().out
    # status, verify and rebuild said "0 behind", "DIFFERENT" or rebuilt nothing: each
    # now names the missing topic in one line, and fails.
    where = ["--bootstrap", kafka_bootstrap, "--database-url", fresh_database, "--topic", typo]
    assert cli(["status", *where]) == 1
    said = capsys.readouterr().out
    assert f"attention  topic {typo!r} does not exist on the broker" in said, said
    assert "message(s) behind" not in said
    for command in (["verify"], ["rebuild", "--yes"]):
        with pytest.raises(SystemExit) as refused:
            cli([*command, *where])
        said = str(refused.value.code)
        assert said.startswith(f"kvledger {command[0]}: topic {typo!r} does not exist"), said
        assert f"did you mean {real!r}" in said


def test_ctrl_c_is_one_line_not_a_traceback(kafka_bootstrap: str, make_topic) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C in `simulate` printed a 20-line traceback (`verify` 78, `demo` 49): one line
    now, and the shell's exit status for an interrupt."""
    topic = make_topic("ctrl-c", partitions=12)
    run = subprocess.Popen(
        [sys.executable, "-m", "kvledger", "simulate", "--topic", topic, "--bootstrap",
         kafka_bootstrap, "--instances", "4", "--requests", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(4)  # publishing by now
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    lines = [line for line in err.splitlines() if "Traceback" in line or "interrupted" in line]
    assert run.returncode == 130, err[-2000:]
    assert lines == ["kvledger simulate: interrupted"], err[-2000:]


def test_each_topic_has_its_own_dead_letter_topic(
    kafka_bootstrap: str,
    fresh_database: str,
    make_topic,
    kafka_admin,  # type: ignore[no-untyped-def]
) -> None:
    """The dead-letter topic was kv-events.dlq whatever --topic said (issue 48's item 15):
    a topic's rejections now go to <topic>.dlq unless --dlq-topic names another."""
    topic = make_topic("own-dlq", partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topic, b"not an envelope", b"engine-x/0")
    producer.flush(30)
    group = f"g-{uuid.uuid4().hex[:8]}"
    try:
        assert cli(["consume", "--until-caught-up", "--bootstrap", kafka_bootstrap,
                    "--database-url", fresh_database, "--topic", topic,
                    "--consumer-group", group]) == 0  # fmt: skip
        from confluent_kafka import Consumer

        reader = Consumer({
            "bootstrap.servers": kafka_bootstrap, "group.id": group + "-r",
            "auto.offset.reset": "earliest", "enable.auto.commit": False,
        })  # fmt: skip
        reader.subscribe([f"{topic}.dlq"])
        got = None
        deadline = time.monotonic() + 30
        while got is None and time.monotonic() < deadline:
            msg = reader.poll(0.5)
            got = msg if msg is not None and msg.error() is None else None
        reader.close()
        assert got is not None and got.value() == b"not an envelope"
    finally:
        for future in kafka_admin.delete_topics([f"{topic}.dlq"]).values():
            with contextlib.suppress(Exception):
                future.result(timeout=30)


def test_status_shows_the_index_at_a_glance(
    kafka_bootstrap: str,
    fresh_database: str,
    make_topic,
    capsys,  # type: ignore[no-untyped-def]
) -> None:
    """`kvledger status` (issue 48): one command for what needed several queries: the
    schema, sources by state, blocks by tier, rejections pending, the group's lag."""
    from kvledger.fleet import FleetConfig
    from kvledger.simulate_cmd import run_simulation

    topic = make_topic("status", partitions=3)
    dlq = make_topic("status-dlq", partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    run_simulation(kafka_bootstrap, topic, FleetConfig(instances=3, requests=20, seed=2),
                   partitions=3, show_progress=False)  # fmt: skip
    common = ["--database-url", fresh_database, "--bootstrap", kafka_bootstrap, "--topic", topic,
              "--consumer-group", group]  # fmt: skip
    assert cli(["consume", "--until-caught-up", *common, "--dlq-topic", dlq]) == 0
    capsys.readouterr()
    assert cli(["status", *common, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["schema"] and sum(status["sources"].values()) == 3, status
    assert status["held"]["CPU"] + status["held"]["STORAGE"] > 0, status  # GPU ended: goodbye
    assert status["behind"] == 0 and status["attention"] == [], status
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topic, b"not an envelope", b"engine-x/0")
    producer.flush(30)
    assert cli(["status", *common]) == 0  # one message not applied yet: said, not alarming
    assert "1 message(s) behind" in capsys.readouterr().out
    # Behind, with nothing stored for longer than --stalled-after: a stalled consumer.
    assert cli(["status", *common, "--stalled-after", "0"]) == 1
    said = capsys.readouterr().out
    assert f"attention  the consumer (group {group} on {topic}) is 1 message(s) behind" in said
    assert "is `kvledger consume` running?" in said
    assert cli(["consume", "--until-caught-up", *common, "--dlq-topic", dlq]) == 0
    capsys.readouterr()
    assert cli(["status", *common]) == 1
    said = capsys.readouterr().out
    assert "rejected   1 pending (undecodable 1)" in said and "kvledger dlq list" in said
    # A consumer group that never read the topic others did: a typo, named, not "behind".
    typo = [*common[:-1], group + "-typo"]
    assert cli(["status", *typo]) == 1
    said = capsys.readouterr().out
    assert f"consumer group {group}-typo has stored no offsets for {topic}" in said, said
    assert f"fed by {group}" in said
    # A broker that does not answer: the index's summary still shows, and the broker is named.
    away = ["--database-url", fresh_database, "--bootstrap", f"127.0.0.1:{free_port()}"]
    assert cli(["status", *away]) == 1
    said = capsys.readouterr().out
    assert "sources    3" in said and "attention  Kafka: no broker answered" in said, said
    # A broker whose name does not resolve: one line at once, not "no broker answered" later.
    with pytest.raises(SystemExit) as refused:
        cli(["status", "--database-url", fresh_database, "--bootstrap", "nosuchhost.invalid:9092"])
    assert "'nosuchhost.invalid' does not resolve" in str(refused.value.code)


def test_a_router_started_before_its_topic_says_so_then_follows_it(
    kafka_bootstrap: str,
    fresh_database: str,
    kafka_admin,  # type: ignore[no-untyped-def]
) -> None:
    """`serve --memory` on a topic that does not exist answered /healthz 200 with
    "offsets {}", and never read the topic once it was made. The router now says why it
    is not following (position's error: /healthz 503), and follows the topic once it is
    made."""
    from confluent_kafka.admin import NewTopic

    from kvledger.consumer.db import connect
    from kvledger.serving.router.index import RouterIndex

    topic = f"late-{uuid.uuid4().hex[:12]}"
    router = RouterIndex(kafka_bootstrap, topic, f"g-{uuid.uuid4().hex[:8]}")
    with connect(fresh_database) as conn:
        router.bootstrap(conn)
    router.start()
    try:
        why = router.position().error or ""
        assert f"topic {topic!r} does not exist on the broker" in why, why
        kafka_admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
        deadline = time.monotonic() + 30
        while router.position().error is not None:
            assert time.monotonic() < deadline, router.position()
            time.sleep(0.2)
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(topic, b"not an envelope", b"engine-x/0")
        producer.flush(30)
        while router.position().applied.get(0) != 1:
            assert time.monotonic() < deadline + 30, router.position()
            time.sleep(0.2)
    finally:
        router.stop()
        with contextlib.suppress(Exception):
            kafka_admin.delete_topics([topic])[topic].result(timeout=30)
