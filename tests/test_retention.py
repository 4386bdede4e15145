"""Bounded storage on a real PostgreSQL server (and Kafka where a consumer runs): time
partitions made ahead and dropped whole, dead blocks expired, a live residency never
touched, readers that say where the retained window starts, and the migration of a
populated index."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from confluent_kafka import Producer

from kvledger.cli import main as cli
from kvledger.consumer.db import connect, create_database, downgrade, drop_database, migrate
from kvledger.consumer.retention import (
    Retention,
    ensure_partitions,
    run_pass,
    set_partition_interval,
    status,
)
from kvledger.consumer.verify import verify
from kvledger.serving.lookup.api import NotRetainedError, PrefixIndex
from tests.helpers.consuming import consume
from tests.helpers.streams import Stream, h, removed, spec, stored

pytestmark = pytest.mark.integration

SECOND = timedelta(seconds=1)


def _count(url: str, table: str, where: str = "true") -> int:
    with connect(url, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM kvledger.{table} WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


_PLACED = "SELECT c.relname FROM kvledger.events e JOIN pg_class c ON c.oid = e.tableoid"


def _kvledger(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvledger", *argv],
        check=False, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def _produce(bootstrap: str, topic: str, stream: Stream) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for m in stream.messages:
        producer.produce(topic, value=m.value, key=m.key, partition=0)
    assert producer.flush(30) == 0


def test_retention_drops_whole_partitions_and_never_a_live_residency(
    fresh_database: str, kafka_bootstrap: str, make_topic, group_id: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """engine-0 stores blocks 1-5 and removes 1-3. Past the retention, a pass drops the
    partitions holding the audit rows and the closed intervals of 1-3 and deletes the block
    rows 1-3 (no one holds them, no retained history names them); 4 and 5 stay held, their
    open intervals and block rows kept. As-of lookups before the window are refused with
    where it starts, after it answered; verify compares within the window and is OK."""
    with connect(fresh_database, autocommit=True) as conn:
        set_partition_interval(conn, SECOND)
    topic = make_topic("retained", partitions=1)
    stream = Stream(topic)
    stream.send("engine-0", spec(0))
    stream.send("engine-0", stored([1, 2, 3, 4, 5]))
    stream.send("engine-0", removed([1, 2, 3]))
    _produce(kafka_bootstrap, topic, stream)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert _count(fresh_database, "events") == 3
    assert _count(fresh_database, "residency_history", "removed_at IS NOT NULL") == 3
    applied = datetime.now(UTC)

    time.sleep(3.5)
    with connect(fresh_database, autocommit=True) as conn:
        report = run_pass(conn, Retention(history=2 * SECOND, audit=2 * SECOND, blocks=SECOND))
        held = conn.execute(
            "SELECT block_hash, refcount FROM kvledger.residencies ORDER BY block_hash"
        ).fetchall()
        open_rows = conn.execute(
            "SELECT block_hash FROM kvledger.residency_history WHERE removed_at IS NULL "
            "ORDER BY block_hash"
        ).fetchall()
        blocks = conn.execute("SELECT block_hash FROM kvledger.blocks ORDER BY 1").fetchall()
        index = PrefixIndex(conn)
        with pytest.raises(NotRetainedError, match=r"before .* is not retained"):
            index.match_at("m", 0, [h(4), h(5)], applied - 10 * SECOND)
        now = index.match_at("m", 0, [h(4), h(5)], datetime.now(UTC))
    tables = {table for table, _ in report.dropped}
    assert {"events", "residency_history"} <= tables and report.skipped is None
    assert report.blocks_deleted == 3
    assert [(bytes(b), n) for b, n in held] == [(h(4), 1), (h(5), 1)]
    assert [bytes(b) for (b,) in open_rows] == [h(4), h(5)]
    assert [bytes(b) for (b,) in blocks] == [h(4), h(5)]
    assert _count(fresh_database, "events") == 0
    assert _count(fresh_database, "residency_history", "removed_at IS NOT NULL") == 0
    assert [(x.instance, x.matched_blocks) for x in now] == [("engine-0", 2)]
    assert set(report.windows) == {
        "events",
        "rejected_events",
        "decisions",
        "residency_history",
        "blocks",
    }
    assert all(since > applied - 2 * SECOND for since in report.windows.values())

    result = verify(kafka_bootstrap, fresh_database, topic, group_id)
    assert result.ok, result.differences
    assert result.log_starts == {}  # the topic still holds every record
    assert result.not_compared["events"] == (0, 3)  # the rebuild has them, the index not
    assert result.not_compared["residency_history"] == (0, 3)
    assert result.not_compared["blocks"] == (0, 3)

    capsys.readouterr()
    assert cli(["sources", "--database-url", fresh_database]) == 0
    assert "retained (older rows dropped by retention): blocks since" in capsys.readouterr().out


def test_the_running_consumer_applies_retention_on_its_own(
    fresh_database: str, kafka_bootstrap: str, make_topic, group_id: str
) -> None:
    """`kvledger consume` with short retention: its own passes drop what aged out while it
    keeps applying, and the metrics say where the windows start."""
    from kvledger.consumer import metrics
    from kvledger.consumer.config import ConsumerConfig
    from kvledger.consumer.service import IndexConsumer

    with connect(fresh_database, autocommit=True) as conn:
        set_partition_interval(conn, SECOND)
    topic = make_topic("retaining", partitions=1)
    stream = Stream(topic)
    stream.send("engine-0", spec(0))
    stream.send("engine-0", stored([1, 2]))
    stream.send("engine-0", removed([1]))
    _produce(kafka_bootstrap, topic, stream)
    service = IndexConsumer(
        ConsumerConfig(
            bootstrap_servers=kafka_bootstrap, database_url=fresh_database, topic=topic,
            group_id=group_id, dlq_topic=None, batch_timeout_s=0.2,
            retention=Retention(history=2 * SECOND, audit=2 * SECOND, blocks=SECOND),
            retention_every_s=0.5,
        )
    )  # fmt: skip
    runner = threading.Thread(target=service.run)
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while _count(fresh_database, "events") < 3:
            assert time.monotonic() < deadline, "the consumer did not apply the stream"
            time.sleep(0.2)
        while _count(fresh_database, "events") or _count(fresh_database, "blocks", "true") > 1:
            assert time.monotonic() < deadline, "the consumer's retention did not run"
            time.sleep(0.5)
    finally:
        service.stop()
        runner.join(30)
    assert _count(fresh_database, "residencies") == 1  # block 2, still held
    assert metrics.RETAINED_SINCE.labels("events")._value.get() > time.time() - 60


def test_a_busy_table_makes_the_pass_wait_for_the_next_not_block_the_consumer(
    fresh_database: str,
) -> None:
    """A reader holding the audit log (a long report, say) keeps its partitions: the pass
    gives up on its lock within its timeout and says so, instead of queueing in front of
    every later query on the table; the other tables' partitions are dropped meanwhile (one
    table a transaction)."""
    with connect(fresh_database, autocommit=True) as conn:
        set_partition_interval(conn, SECOND)
        conn.execute(
            "INSERT INTO kvledger.events (kafka_topic, kafka_partition, kafka_offset, status) "
            "VALUES ('t', 0, 0, 'applied')"
        )
    time.sleep(2.5)
    with connect(fresh_database) as reader, connect(fresh_database, autocommit=True) as conn:
        reader.execute("SELECT count(*) FROM kvledger.events").fetchone()  # holds its lock
        started = time.monotonic()
        report = run_pass(conn, Retention(SECOND, SECOND, SECOND), lock_timeout="200ms")
        waited = time.monotonic() - started
        reader.rollback()
        assert report.skipped is not None and "busy" in report.skipped
        assert waited < 5
        dropped = {table for table, _ in report.dropped}
        assert "events" not in dropped and "residency_history" in dropped
        assert _count(fresh_database, "events") == 1
        assert run_pass(conn, Retention(SECOND, SECOND, SECOND)).dropped  # free: it goes
    assert _count(fresh_database, "events") == 0


def test_a_row_in_a_default_partition_moves_into_its_partition_when_made(
    fresh_database: str,
) -> None:
    """Partitions ran out (no pass for a while): rows land in the default partition rather
    than fail, and move into their own partition once it is made."""
    with connect(fresh_database, autocommit=True) as conn:
        set_partition_interval(conn, SECOND)
        later = conn.execute("SELECT max(hi) + interval '5 seconds' FROM kvledger.time_partitions")
        (when,) = later.fetchone() or (None,)
        conn.execute(
            "INSERT INTO kvledger.events (kafka_topic, kafka_partition, kafka_offset, status, "
            "applied_at) VALUES ('t', 0, 0, 'applied', %s)",
            (when,),
        )
        where = conn.execute(
            "SELECT c.relname FROM kvledger.events e JOIN pg_class c ON c.oid = e.tableoid"
        ).fetchone()
        assert where == ("events_default",)
        with conn.transaction():
            conn.execute("SELECT kvledger.ensure_partitions(now(), %s)", (when + 2 * SECOND,))
        where = conn.execute(
            "SELECT c.relname FROM kvledger.events e JOIN pg_class c ON c.oid = e.tableoid"
        ).fetchone()
        assert where is not None and where[0].startswith("events_p")
        assert ensure_partitions(conn) == 0  # nothing more to make
    assert status_tables(fresh_database)["events"] > 0


def status_tables(url: str) -> dict[str, int]:
    with connect(url, autocommit=True) as conn:
        return {name: t.partitions for name, t in status(conn).tables.items()}


def test_a_populated_index_is_converted_in_place_and_back(database_url: str) -> None:
    """Revision 0014 on an index with history, audit and rejections from before it: every
    row kept with its times; open intervals in the open partition, closed ones and the audit
    in time partitions (rows older than 35 days in the default one, deleted by the first
    pass); and back down to 0013 with the same rows."""
    name = f"kvl_test_convert_{os.getpid()}"
    url = create_database(database_url, name, replace=True)
    history = (
        "model, group_idx, block_hash, instance, medium, ownership, stored_at, removed_at, "
        "removed_by, stored_partition, stored_offset"
    )
    try:
        migrate(url, "0013")
        with connect(url, autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO kvledger.residency_history ({history}) VALUES "
                "('m', 0, '\\x01', 'e0', 'GPU', '', now() - interval '3 days', "
                " now() - interval '2 days', 'removed', 0, 1), "
                "('m', 0, '\\x02', 'e0', 'GPU', '', now() - interval '1 day', NULL, NULL, 0, 2)"
            )
            conn.execute(
                "INSERT INTO kvledger.events (kafka_topic, kafka_partition, kafka_offset, "
                "status, applied_at) VALUES ('t', 0, 1, 'applied', now() - interval '40 days'), "
                "('t', 0, 2, 'applied', now() - interval '1 hour')"
            )
            conn.execute(
                "INSERT INTO kvledger.rejected_events (kafka_topic, kafka_partition, "
                "kafka_offset, raw, reason, detail) VALUES ('t', 0, 3, '\\x00', 'undecodable', "
                "'cut short')"
            )

            def rows() -> tuple[list[tuple[object, ...]], ...]:
                return (
                    conn.execute(f"SELECT {history} FROM kvledger.residency_history ORDER BY 3")
                    .fetchall(),
                    conn.execute("SELECT kafka_offset, applied_at FROM kvledger.events ORDER BY 1")
                    .fetchall(),
                    conn.execute("SELECT id, raw, reason FROM kvledger.rejected_events").fetchall(),
                )  # fmt: skip

            before = rows()
            migrate(url)
            assert rows() == before
            placed = conn.execute(
                "SELECT c.relname FROM kvledger.residency_history h "
                "JOIN pg_class c ON c.oid = h.tableoid ORDER BY block_hash"
            ).fetchall()
            assert placed[0][0].startswith("residency_history_p")
            assert placed[1] == ("residency_history_open",)
            audit = conn.execute(
                "SELECT c.relname FROM kvledger.events e JOIN pg_class c ON c.oid = e.tableoid "
                "ORDER BY kafka_offset"
            ).fetchall()
            assert audit[0] == ("events_default",)  # 40 days old
            assert audit[1][0].startswith("events_p")
            # A consumer goes on where 0013 stopped: the open interval closes.
            conn.execute(
                "UPDATE kvledger.residency_history SET removed_at = now(), closed_at = now(), "
                "removed_by = 'removed' WHERE removed_at IS NULL"
            )
            assert conn.execute("SELECT nextval('kvledger.residency_history_id_seq')").fetchone()
            report = run_pass(conn, Retention())
            assert report.dropped and _count(url, "events") == 1  # the 40-day-old row gone
            downgrade(url, "0013")
            after = rows()
        assert len(after[0]) == 2 and after[1] == before[1][1:] and after[2] == before[2]
    finally:
        drop_database(database_url, name)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--history-retention", "10"], "argument --history-retention: '10' is not a duration"),
        (["--audit-retention", "0s"], "argument --audit-retention: '0s' is not a duration"),
        (["--block-retention=-5m"], "argument --block-retention: '-5m' is not a duration"),
        (["--history-retention", "1s"], "--history-retention 1s is shorter than the partition"),
        (["--audit-retention", "2000d"], "--audit-retention 2000d would keep 2,000 partitions"),
    ],
)
def test_a_retention_kvledger_cannot_use_is_a_usage_error_naming_the_option(
    fresh_database: str, argv: list[str], said: str
) -> None:
    done = _kvledger("retention", "--database-url", fresh_database, *argv)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr


def test_retention_from_the_environment_and_once_from_the_command_line(
    fresh_database: str,
) -> None:
    env = {**os.environ, "KVLEDGER_RETENTION_HISTORY_RETENTION": "7"}
    done = _kvledger("retention", "--database-url", fresh_database, env=env)
    assert done.returncode == 2
    assert "$KVLEDGER_RETENTION_HISTORY_RETENTION: '7' is not a valid value" in done.stderr
    done = _kvledger("retention", "--database-url", fresh_database, "--once", "--json")
    assert done.returncode == 0, done.stderr
    assert '"pass": {"made": ' in done.stdout and '"partition_interval_s": 86400.0' in done.stdout


def test_a_partition_interval_below_a_second_is_refused(fresh_database: str) -> None:
    with (
        connect(fresh_database, autocommit=True) as conn,
        pytest.raises(psycopg.errors.InvalidParameterValue, match="at least 1 second"),
    ):
        set_partition_interval(conn, timedelta(milliseconds=10))
    done = _kvledger("migrate", "--database-url", fresh_database, "--partition-interval", "0.5s")
    assert done.returncode == 2
    assert "--partition-interval 0.5s: partitions span at least 1s" in done.stderr


def test_passes_of_several_consumers_at_once_do_not_collide(fresh_database: str) -> None:
    """Every consumer of a group runs passes: at the same instant, one makes and drops the
    partitions and the others wait for it, then find nothing left to do."""
    with connect(fresh_database, autocommit=True) as conn:
        set_partition_interval(conn, SECOND)
    time.sleep(2.5)  # partitions to drop, and new ones to make
    errors: list[BaseException] = []
    dropped: list[int] = []

    def one_pass() -> None:
        try:
            with connect(fresh_database, autocommit=True) as conn:
                dropped.append(len(run_pass(conn, Retention(SECOND, SECOND, SECOND)).dropped))
        except BaseException as exc:
            errors.append(exc)

    passes = [threading.Thread(target=one_pass) for _ in range(4)]
    for t in passes:
        t.start()
    for t in passes:
        t.join(60)
    assert errors == [] and len(dropped) == 4
    assert sum(dropped) >= 3  # each expired partition dropped once, by whichever came first
    with connect(fresh_database, autocommit=True) as conn:
        names = conn.execute("SELECT partition FROM kvledger.time_partitions").fetchall()
    assert len(names) == len(set(names)) and names


def test_engines_lives_and_refused_decision_records_are_trimmed_past_the_audit_retention(
    fresh_database: str, kafka_bootstrap: str, make_topic, group_id: str
) -> None:
    """The audit tables that are not partitioned are bounded too: engine-0 restarted twice
    and engine-1 once, a minute ago; past the audit retention a pass deletes engine-0's older
    restart and keeps each source's newest (its "last restart" unchanged), deletes an old
    refused decision record and keeps a new one; verify compares within the window."""
    with connect(fresh_database, autocommit=True) as conn:
        set_partition_interval(conn, SECOND)
    topic = make_topic("lives", partitions=1)
    stream = Stream(topic)
    old = int(time.time() * 1000) - 60_000
    for source, epochs in (("engine-0", 3), ("engine-1", 2)):
        stream.send(source, spec(0), time_ms=old)
        for epoch in range(1, epochs + 1):
            stream.send(source, stored([epoch]), epoch=epoch, time_ms=old + epoch * 1000)
    _produce(kafka_bootstrap, topic, stream)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    restarts = "kind = 'restart'"
    assert _count(fresh_database, "lifecycle_events", restarts) == 3
    with connect(fresh_database, autocommit=True) as conn:
        last = conn.execute(
            "SELECT source, last_restart FROM kvledger.source_status ORDER BY 1"
        ).fetchall()
        conn.execute(
            "INSERT INTO kvledger.rejected_decisions (kafka_topic, kafka_partition, "
            "kafka_offset, raw, reason, recorded_at) VALUES "
            "('d', 0, 0, 'x', 'not a decision', now() - interval '1 hour'), "
            "('d', 0, 1, 'y', 'not a decision', now())"
        )
        report = run_pass(conn, Retention(history=timedelta(days=1), audit=30 * SECOND,
                                          blocks=timedelta(days=1)))  # fmt: skip
        kept = conn.execute(
            "SELECT source, epoch FROM kvledger.lifecycle_events WHERE kind = 'restart' ORDER BY 1"
        ).fetchall()
        assert (
            conn.execute(
                "SELECT source, last_restart FROM kvledger.source_status ORDER BY 1"
            ).fetchall()
            == last
        )
        offsets = conn.execute("SELECT kafka_offset FROM kvledger.rejected_decisions").fetchall()
    assert report.audit_trimmed == {"lifecycle_events": 1, "rejected_decisions": 1}
    assert kept == [("engine-0", 3), ("engine-1", 2)]
    assert offsets == [(1,)]
    assert "lifecycle_events" in report.windows
    result = verify(kafka_bootstrap, fresh_database, topic, group_id)
    assert result.ok, result.differences
    assert result.not_compared["lifecycle_events"] == (0, 1)
