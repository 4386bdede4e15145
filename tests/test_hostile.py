"""Hostile input through the real apply path (real Kafka, real PostgreSQL): every message ends
applied or rejected with a reason and its bytes, the consumer catches up, and a valid event
after it still applies."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect
from kvledger.consumer.service import IndexConsumer
from kvledger.consumer.summary import RunSummary
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventsLost,
    GroupSpec,
    Heartbeat,
    KVEvent,
)
from kvledger.schemas.topics import message_key

pytestmark = pytest.mark.integration

T0 = 1_764_000_000_000
CODEC = Codec()


def _consume(bootstrap: str, db: str, topic: str, group: str, **more: object) -> RunSummary:
    config = ConsumerConfig(
        bootstrap_servers=bootstrap, database_url=db, topic=topic, group_id=group,
        dlq_topic=f"{topic}.dlq", batch_size=500, batch_timeout_s=0.2, until_caught_up=True,
        retry_backoff_s=0.05, **more,  # type: ignore[arg-type]
    )  # fmt: skip
    return IndexConsumer(config).run()


def _send(bootstrap: str, topic: str, items: list[tuple[bytes | None, bytes]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 2_000_000})
    for key, value in items:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def _env(source: str, seq: int, event: KVEvent, epoch: int = 1) -> tuple[bytes, bytes]:
    group = event.group_idx if event.group_idx is not None else 0
    env = Envelope(source, "m", 0, epoch, seq, T0 + min(seq, 10**9), event)
    return message_key(source, group), CODEC.encode(env)


def _stored(h: int, start: int = 0, medium: str = "CPU") -> BlockStored:
    return BlockStored((h.to_bytes(8, "big"),), None, tuple(range(4)), 4, None, medium, None,
                       group_idx=0, token_start=start)  # fmt: skip


def _caught_up(db: str, topic: str, group: str, bootstrap: str) -> bool:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    meta = c.list_topics(topic, timeout=10).topics[topic]
    ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in meta.partitions}  # fmt: skip
    c.close()
    with connect(db, autocommit=True) as conn:
        stored = dict(
            conn.execute(
                "SELECT kafka_partition, next_offset FROM kvledger.consumer_offsets "
                "WHERE consumer_group = %s AND kafka_topic = %s",
                (group, topic),
            ).fetchall()
        )
    return all(stored.get(p, 0) == end for p, end in ends.items() if end > 0)


# ---------------------------------------------------------------------- isolation
def test_a_message_the_store_fails_on_is_isolated_and_the_rest_applies(
    kafka_bootstrap: str, fresh_database: str, make_topic: Callable[..., str], group_id: str
) -> None:
    """PostgreSQL itself refuses what one source sends (a trigger raises, as any store error
    would): the batch is split until that message is alone, it is rejected with the error,
    everything else applies, and the consumer is caught up."""
    topic = make_topic("isolate", partitions=1)
    with connect(fresh_database, autocommit=True) as conn:
        conn.execute(
            """
            CREATE FUNCTION test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.instance = 'poison' THEN
                    RAISE EXCEPTION 'the store refuses %', NEW.instance;
                END IF;
                IF NEW.instance = 'flaky' THEN
                    RAISE EXCEPTION 'could not serialize' USING ERRCODE = '40001';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER test_poison BEFORE INSERT ON kvledger.residencies
            FOR EACH ROW EXECUTE FUNCTION test_poison();
            """
        )
    spec = GroupSpec("m", 0, "full_attention", 4, 4)
    items = [_env(s, 0, spec) for s in ("good", "poison", "flaky")]
    for i in range(1, 120):
        source = "poison" if i in (17, 80) else "flaky" if i == 55 else "good"
        items.append(_env(source, i if source == "good" else {17: 1, 80: 2, 55: 1}[i],
                          _stored(i)))  # fmt: skip
    _send(kafka_bootstrap, topic, items)
    summary = _consume(kafka_bootstrap, fresh_database, topic, group_id, max_batch_retries=3)
    assert summary.rejected_by_reason == {"apply_error": 3}
    assert _caught_up(fresh_database, topic, group_id, kafka_bootstrap)
    with connect(fresh_database, autocommit=True) as conn:
        details = [
            d for (d,) in conn.execute(
                "SELECT detail FROM kvledger.rejected_events ORDER BY kafka_offset"
            ).fetchall()
        ]  # fmt: skip
        held = conn.execute(
            "SELECT count(*) FROM kvledger.residencies WHERE instance = 'good'"
        ).fetchone()
        conn.execute("DROP TRIGGER test_poison ON kvledger.residencies")
    assert "the store refuses poison" in details[0] and "could not serialize" in details[1]
    assert held == (116,)
    _send(kafka_bootstrap, topic, [_env("poison", 3, _stored(500))])  # now it applies
    summary = _consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert (summary.applied, summary.rejected) == (1, 0)


# ---------------------------------------------------------------------- property-based
_int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
_text = st.one_of(
    st.none(), st.sampled_from(["GPU", "CPU", "STORAGE", "LOCAL", "disk", ""]),
    st.text(max_size=8), st.just("a\x00b"), st.just("x" * 3000),
)  # fmt: skip
_hash = st.binary(min_size=0, max_size=70)


def _mostly(sane: st.SearchStrategy[object], hostile: st.SearchStrategy[object]) -> Any:
    """Sane values four times in five, so that hostile ones reach the apply path too."""
    return st.integers(0, 4).flatmap(lambda r: sane if r else hostile)


@st.composite
def _events(draw: st.DrawFn) -> KVEvent:
    group = draw(_mostly(st.sampled_from([None, 0, 1]), st.one_of(st.just(7), _int32)))
    kind = draw(st.sampled_from(["stored", "removed", "cleared", "spec", "beat", "lost"]))
    if kind == "stored":
        n = draw(st.integers(0, 3))
        size = draw(st.one_of(st.sampled_from([0, 4]), _int32))
        tokens = tuple(draw(st.lists(_int32, max_size=12)))
        return BlockStored(
            tuple(draw(_hash) for _ in range(n)), draw(st.one_of(st.none(), _hash)), tokens,
            size, draw(st.one_of(st.none(), _int32)), draw(_text), draw(_text),
            extra_keys=draw(st.one_of(st.none(), st.lists(_text, max_size=3).map(tuple))),
            group_idx=group, kv_cache_spec_kind=draw(_text), locality=draw(_text),
            ownership=draw(_text), token_start=draw(st.one_of(st.none(), _int64)),
            partial=draw(st.booleans()),
        )  # fmt: skip
    if kind == "removed":
        hashes = tuple(draw(st.lists(_hash, max_size=3)))
        return BlockRemoved(hashes, draw(_text), group, draw(_text), draw(_text))
    if kind == "cleared":
        return AllBlocksCleared(group_idx=group, medium=draw(_text))
    if kind == "spec":
        return GroupSpec(
            draw(st.sampled_from(["m", "other", "m\x00"])), group if group is not None else 0,
            draw(st.sampled_from(["full_attention", "mamba", "bogus"])), draw(_int32),
            draw(_int32), draw(st.one_of(st.none(), _int32)),
            draw(st.one_of(st.none(), st.lists(_text.filter(lambda t: t is not None),
                                               max_size=2).map(tuple))),
        )  # fmt: skip
    if kind == "beat":
        return Heartbeat(group_idx=group, interval_ms=draw(st.one_of(st.none(), _int64)))
    return EventsLost(draw(_int64), draw(_int64), group_idx=group)


@st.composite
def _messages(draw: st.DrawFn) -> tuple[bytes | None, bytes]:
    event = draw(_events())
    source = draw(_mostly(st.sampled_from(["s1", "s2"]), st.sampled_from(["s\x00", "y" * 600])))
    env = Envelope(
        source, draw(_mostly(st.just("m"), st.just("m\x00"))),
        draw(_mostly(st.just(0), _int32)), draw(_mostly(st.integers(1, 3), _int64)),
        draw(_mostly(st.integers(0, 40), _int64)),
        draw(_mostly(st.integers(T0, T0 + 10**6), _int64)), event,
    )  # fmt: skip
    group = event.group_idx if event.group_idx is not None else 0
    right = message_key(source, group)
    key = draw(_mostly(st.just(right), st.sampled_from([b"s1/0", None])))
    return key, CODEC.encode(env)


@pytest.mark.timeout(900)
def test_any_envelope_ends_applied_or_rejected_and_a_valid_one_still_applies(
    kafka_bootstrap: str, fresh_database: str, make_topic: Callable[..., str], group_id: str
) -> None:
    topic = make_topic("fuzz", partitions=2)
    spec = _env("ok", 0, GroupSpec("m", 0, "full_attention", 4, 4))
    _send(kafka_bootstrap, topic, [spec])
    _consume(kafka_bootstrap, fresh_database, topic, group_id)
    state = {"seq": 1, "sent": 1}

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_messages(), min_size=1, max_size=15))
    def round_(messages: list[tuple[bytes | None, bytes]]) -> None:
        valid = _env("ok", state["seq"], _stored(10_000 + state["seq"], medium="GPU"))
        state["seq"] += 1
        _send(kafka_bootstrap, topic, [*messages, valid])
        state["sent"] += len(messages) + 1
        summary = _consume(kafka_bootstrap, fresh_database, topic, group_id)
        assert summary.messages == len(messages) + 1
        assert _caught_up(fresh_database, topic, group_id, kafka_bootstrap)
        with connect(fresh_database, autocommit=True) as conn:
            status = conn.execute(
                "SELECT status FROM kvledger.events e WHERE e.source = 'ok' AND e.seq = %s",
                (state["seq"] - 1,),
            ).fetchone()
        assert status == ("applied",)  # the valid event after the hostile ones

    round_()
    with connect(fresh_database, autocommit=True) as conn:
        audited = conn.execute("SELECT count(*) FROM kvledger.events").fetchone()
        unexplained = conn.execute(
            "SELECT count(*) FROM kvledger.events e WHERE e.status = 'rejected' AND NOT EXISTS "
            "(SELECT 1 FROM kvledger.rejected_events r WHERE r.kafka_topic = e.kafka_topic "
            "AND r.kafka_partition = e.kafka_partition AND r.kafka_offset = e.kafka_offset)"
        ).fetchone()
    assert audited == (state["sent"],)  # every message audited: applied or rejected
    assert unexplained == (0,)  # every rejection kept with its bytes


# ---------------------------------------------------------------------- dead letters
def test_a_rejection_too_large_for_the_dead_letter_topic_is_sent_truncated(
    kafka_bootstrap: str, fresh_database: str, make_topic: Callable[..., str], group_id: str,
    kafka_admin: Any,
) -> None:  # fmt: skip
    """The main topic takes 2 MB messages, the dead-letter topic 20 kB: the broker refuses a
    100 kB rejection and the client a 1.5 MB one; both reach the DLQ truncated, both are
    whole in rejected_events, and the consumer is caught up."""
    from confluent_kafka.admin import NewTopic

    from tests.helpers.kafka import consume_all

    topic = make_topic("big", partitions=1, **{"max.message.bytes": "2000000"})
    dlq = f"{topic}.dlq"
    kafka_admin.create_topics([NewTopic(dlq, 3, 1, config={"max.message.bytes": "20000"})])[
        dlq
    ].result(30)
    try:
        garbage = [b"\x00" + bytes(100_000), b"\x00" + bytes(1_500_000)]
        valid = _env("ok", 0, GroupSpec("m", 0, "full_attention", 4, 4))
        _send(kafka_bootstrap, topic, [(b"x/0", g) for g in garbage] + [valid])
        summary = _consume(kafka_bootstrap, fresh_database, topic, group_id)
        assert (summary.applied, summary.rejected) == (1, 2)
        assert _caught_up(fresh_database, topic, group_id, kafka_bootstrap)
        with connect(fresh_database, autocommit=True) as conn:
            sizes = [
                n for (n,) in conn.execute(
                    "SELECT length(raw) FROM kvledger.rejected_events ORDER BY kafka_offset"
                ).fetchall()
            ]  # fmt: skip
        assert sizes == [len(g) for g in garbage]
        records = consume_all(kafka_bootstrap, dlq, group_id + "-dlq", 2)
        truncated = sorted(int(dict(m.headers())["kvledger.truncated"]) for m in records)
        assert truncated == [len(g) for g in garbage]
        assert all(not m.value() for m in records)
    finally:
        kafka_admin.delete_topics([dlq])


def test_dlq_replay_leaves_no_phantom_holder(
    kafka_bootstrap: str, fresh_database: str, make_topic: Callable[..., str], group_id: str
) -> None:
    """A store refused for its size, its removal recorded as a no-op, the spec fixed by an
    operator, `kvledger dlq replay`: the store's block is written but no holder (the removal
    may have been its own); a refused store without a later removal gets its holder."""
    from kvledger.cli import main as cli

    topic = make_topic("phantom", partitions=1)
    spec = GroupSpec("m", 0, "full_attention", 4, 4)

    def sized(h: int) -> BlockStored:
        return BlockStored((h.to_bytes(8, "big"),), None, tuple(range(8)), 8, None, "CPU",
                           None, group_idx=0, token_start=0)  # fmt: skip

    removal = BlockRemoved(((1).to_bytes(8, "big"),), "CPU", 0)
    items = [_env("s", 0, spec), _env("s", 1, sized(1)), _env("s", 2, removal),
             _env("s", 3, sized(2))]  # fmt: skip
    _send(kafka_bootstrap, topic, items)
    summary = _consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert summary.rejected_by_reason == {"block_size_mismatch": 2}
    declare = ["groups", "declare", "--database-url", fresh_database, "--model", "m",
               "--group", "0", "--block-size", "8"]  # fmt: skip
    assert cli(declare) == 0
    assert cli(["dlq", "replay", "--database-url", fresh_database]) == 0
    with connect(fresh_database, autocommit=True) as conn:
        held = conn.execute("SELECT block_hash FROM kvledger.residencies").fetchall()
        blocks = conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone()
        reasons = conn.execute(
            "SELECT seq, reason FROM kvledger.events WHERE event_type = 'BlockStored' ORDER BY seq"
        ).fetchall()
    assert [bytes(h) for (h,) in held] == [(2).to_bytes(8, "big")]
    assert blocks == (2,)
    assert reasons == [(1, "replayed_without_holders"), (3, "replayed")]


# ---------------------------------------------------------------------- operator commands
def test_rebuild_refuses_to_lose_history_or_race_a_consumer(
    kafka_bootstrap: str, fresh_database: str, make_topic: Callable[..., str], group_id: str,
    kafka_admin: Any, capsys: Any,
) -> None:  # fmt: skip
    from confluent_kafka import TopicPartition

    from kvledger.cli import main as cli
    from tests.helpers.consuming import consumer_process

    topic = make_topic("rebuild", partitions=1)
    items = [_env("s", 0, GroupSpec("m", 0, "full_attention", 4, 4))]
    items += [_env("s", i, _stored(i)) for i in range(1, 30)]
    _send(kafka_bootstrap, topic, items)
    _consume(kafka_bootstrap, fresh_database, topic, group_id)
    args = ["rebuild", "--bootstrap", kafka_bootstrap, "--database-url", fresh_database,
            "--topic", topic, "--consumer-group", group_id, "--yes"]  # fmt: skip

    def held() -> int:
        with connect(fresh_database, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM kvledger.residencies").fetchone()
        return int(row[0]) if row else -1

    # A consumer of the live group is running: refused, the index untouched.
    proc = consumer_process(kafka_bootstrap, fresh_database, topic, group_id, False, "r1")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            capsys.readouterr()
            if cli(args) == 2 and "active member" in capsys.readouterr().err:
                break
            time.sleep(1)
        else:
            raise AssertionError("the rebuild was not refused while a consumer ran")
    finally:
        proc.terminate()
        proc.wait(60)
    assert held() == 29
    time.sleep(12)  # the stopped member's session ends
    assert cli(args) == 0  # nothing deleted from the topic: allowed, same index
    assert held() == 29

    # Retention deleted the topic's first ten messages: refused unless asked for.
    kafka_admin.delete_records([TopicPartition(topic, 0, 10)])[
        TopicPartition(topic, 0, 10)
    ].result(30)  # fmt: skip
    capsys.readouterr()
    assert cli(args) == 2
    assert "no longer holds its whole history" in capsys.readouterr().err
    assert held() == 29
    declare = ["groups", "declare", "--database-url", fresh_database, "--model", "m",
               "--group", "0", "--block-size", "4"]  # fmt: skip
    assert cli(declare) == 0  # the deleted announcement, declared (declared specs are kept)
    assert cli([*args, "--accept-partial"]) == 0
    assert held() == 20  # the stores of offsets 10..29


def test_no_message_can_silence_a_source(
    kafka_bootstrap: str, fresh_database: str, make_topic: Callable[..., str], group_id: str
) -> None:
    """Sequence and epoch tricks, wrong keys and values the store cannot hold, each between
    two normal messages of the same stream: each is rejected with its reason and bytes, the
    normal numbers after it apply, and the consumer is caught up."""
    topic = make_topic("silence", partitions=2)
    hostile = [
        (_env("s", 2**62, _stored(900)), "sequence_jump"),
        (_env("s", 5, _stored(901), epoch=2**62), "future_epoch"),
        ((b"other/0", _env("s", 5, _stored(902))[1]), "key_mismatch"),
        (
            _env(
                "s",
                5,
                BlockStored(
                    (b"\x01" * 8,), None, tuple(range(4)), 4, None, "CPU", "lora\x00", group_idx=0
                ),
            ),
            "invalid_event",
        ),
        (_env("s", 1, _stored(903)), "duplicate"),
    ]
    items = [_env("s", 0, GroupSpec("m", 0, "full_attention", 4, 4)), _env("s", 1, _stored(1))]
    for i, (item, _) in enumerate(hostile):
        items += [item, _env("s", 2 + i, _stored(2 + i))]
    _send(kafka_bootstrap, topic, items)
    summary = _consume(kafka_bootstrap, fresh_database, topic, group_id)
    assert summary.rejected_by_reason == {reason: 1 for _, reason in hostile}
    assert summary.applied == 2 + len(hostile)
    assert _caught_up(fresh_database, topic, group_id, kafka_bootstrap)
    with connect(fresh_database, autocommit=True) as conn:
        kept = conn.execute(
            "SELECT reason, raw FROM kvledger.rejected_events ORDER BY kafka_offset"
        ).fetchall()
        state = conn.execute(
            "SELECT epoch, last_seq FROM kvledger.source_health WHERE source = 's'"
        ).fetchone()
    assert sorted((r, bytes(v)) for r, v in kept) == sorted(
        (reason, item[1]) for item, reason in hostile
    )
    assert state == (1, 1 + len(hostile))  # the stream moved only with its normal numbers
