"""The lifecycle rules (consumer.core.lifecycle and the planner), without services:
restarts, goodbyes, heartbeats and liveness, and the old contract."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from kvledger.consumer.core.lifecycle import surviving
from kvledger.consumer.core.model import ResidencyKey
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.pipeline import run_batch
from kvledger.schemas.codec import Codec, released_schemas
from kvledger.schemas.events import Envelope, Goodbye, Heartbeat
from kvledger.schemas.topics import message_key
from tests.helpers.memory_store import MemoryStore
from tests.helpers.streams import MODEL, Stream, h, removed, spec, stored

A = "engine-a"
TIERS = (("GPU", ""), ("CPU", ""), ("STORAGE", "disk"))


def run(messages: Sequence[Inbound], store: MemoryStore) -> MemoryStore:
    run_batch(messages, Codec(), store, "g")
    return store


def key(x: int, medium: str, group: int = 0, own: str = "") -> ResidencyKey:
    return ResidencyKey(MODEL, group, h(x), A, medium, own)


def held(store: MemoryStore) -> set[tuple[int, str, int]]:
    return {(int.from_bytes(k.block_hash, "big"), k.medium, k.group_idx) for k in store.residencies}


def ended(store: MemoryStore, how: str) -> set[tuple[int, str]]:
    return {
        (int.from_bytes(r.key.block_hash, "big"), r.key.medium)
        for r in store.history
        if r.removed_by == how
    }


@pytest.fixture
def s() -> Stream:
    """Engine A (epoch 1) holds block 1 on every tier in groups 0 and 1."""
    stream = Stream()
    for group in (0, 1):
        stream.send(A, spec(group))
        for medium, own in TIERS:
            stream.send(A, stored([1], group=group, medium=medium, ownership=own or None))
    return stream


def test_default_survivors() -> None:
    assert surviving(None) == {"STORAGE"}
    assert surviving(("CPU", "STORAGE")) == {"CPU", "STORAGE"}
    assert surviving(()) == frozenset()


def test_a_restart_ends_what_died_with_the_process_stream_by_stream(s: Stream) -> None:
    store = run(s.messages, MemoryStore())
    assert len(held(store)) == 6
    restart = s.send(A, spec(0), epoch=2)  # the new incarnation announces group 0
    run([restart], store)
    assert held(store) == {(1, "STORAGE", 0), (1, "GPU", 1), (1, "CPU", 1), (1, "STORAGE", 1)}
    assert ended(store, "restart") == {(1, "GPU"), (1, "CPU")}
    [event] = store.lifecycle
    assert (event.kind, event.group_idx, event.epoch, event.previous_epoch) == (
        "restart", 0, 2, 1,
    )  # fmt: skip
    assert (event.ended_gpu, event.ended_cpu, event.ended_storage) == (1, 1, 0)
    assert store.lives[A].restarts == 1 and store.lives[A].epoch == 2
    # Group 1's first message of the new epoch ends its old blocks too (in a later batch).
    run([s.send(A, stored([7], group=1), epoch=2, seq=0)], store)
    assert held(store) == {(1, "STORAGE", 0), (1, "STORAGE", 1), (7, "CPU", 1)}
    assert store.lives[A].restarts == 1  # one restart of the source, two streams
    assert len(store.lifecycle) == 2


def test_the_source_says_what_survives(s: Stream) -> None:
    store = run(s.messages, MemoryStore())
    keep_cpu = dataclasses.replace(spec(0), surviving_media=("CPU", "STORAGE"))
    run([s.send(A, keep_cpu, epoch=2)], store)
    assert {(x, m) for x, m, g in held(store) if g == 0} == {(1, "CPU"), (1, "STORAGE")}
    # Its policy holds for the next restart even when that one opens with a block event.
    run([s.send(A, stored([2], medium="GPU"), epoch=3, seq=0)], store)
    assert {(x, m) for x, m, g in held(store) if g == 0} == {
        (1, "CPU"), (1, "STORAGE"), (2, "GPU"),
    }  # fmt: skip
    nothing = dataclasses.replace(spec(0), surviving_media=())
    run([s.send(A, nothing, epoch=4)], store)
    assert not {x for x, _, g in held(store) if g == 0}


def test_a_restart_inside_one_batch(s: Stream) -> None:
    s.send(A, stored([5], medium="GPU"), epoch=2, seq=0)
    s.send(A, removed([5], medium="GPU"), epoch=2)
    store = run(s.messages, MemoryStore())
    assert {(x, m) for x, m, g in held(store) if g == 0} == {(1, "STORAGE")}
    assert ended(store, "restart") == {(1, "GPU"), (1, "CPU")}


def test_a_goodbye_closes_the_source_and_a_later_message_reopens_it(s: Stream) -> None:
    store = run(s.messages, MemoryStore())
    bye = s.send(A, Goodbye(group_idx=0))
    run([bye], store)
    assert held(store) == {(1, "STORAGE", 0), (1, "STORAGE", 1)}
    assert ended(store, "closed") == {(1, "GPU"), (1, "CPU")}
    assert store.lives[A].closed_at is not None
    [event] = store.lifecycle
    assert (event.kind, event.group_idx, event.ended_gpu + event.ended_cpu) == ("closed", None, 4)
    assert store.events[(bye.topic, 0, bye.offset)].hash_count == 4
    run([s.send(A, Heartbeat(group_idx=0))], store)
    assert store.lives[A].closed_at is None


def test_heartbeats_only_move_the_last_seen_time(s: Stream) -> None:
    store = run(s.messages, MemoryStore())
    before = store.lives[A].last_seen
    late = s.send(A, Heartbeat(group_idx=0, interval_ms=5000), time_ms=2_000_000_000_000)
    run([late], store)
    life = store.lives[A]
    assert life.last_seen == datetime.fromtimestamp(2_000_000_000, tz=UTC) > before
    assert life.heartbeat_ms == 5000 and len(held(store)) == 6
    assert store.events[(late.topic, 0, late.offset)].status == "applied"


def load(store: MemoryStore) -> tuple[int | None, int | None, datetime | None]:
    life = store.lives[A]
    return life.requests_running, life.requests_waiting, life.load_at


def test_a_heartbeat_with_the_engines_load_replaces_it_and_one_without_keeps_it(
    s: Stream,
) -> None:
    store = run(s.messages, MemoryStore())
    assert load(store) == (None, None, None)
    run([s.send(A, Heartbeat(0, 1000, 3, 2), time_ms=2_000_000_000_000)], store)
    at = datetime.fromtimestamp(2_000_000_000, tz=UTC)
    assert load(store) == (3, 2, at)
    run([s.send(A, Heartbeat(0, 1000), time_ms=2_000_000_001_000)], store)
    run([s.send(A, stored([9]))], store)
    assert load(store) == (3, 2, at)  # no new reading: the last one, with its time
    run([s.send(A, Heartbeat(0, 1000, 0, 0), time_ms=2_000_000_002_000)], store)
    assert load(store)[:2] == (0, 0)


@pytest.mark.parametrize("end", ["restart", "goodbye", "model"])
def test_a_restart_a_goodbye_or_another_model_ends_the_load(s: Stream, end: str) -> None:
    store = run([*s.messages, s.send(A, Heartbeat(0, 1000, 5, 1))], MemoryStore())
    assert load(store)[:2] == (5, 1)
    if end == "restart":
        run([s.send(A, Heartbeat(0, 1000), epoch=2)], store)
    elif end == "goodbye":
        run([s.send(A, Goodbye())], store)
    else:
        run([s.send(A, Heartbeat(0, 1000), model="another")], store)
    assert load(store) == (None, None, None)


def test_a_negative_load_is_rejected_and_leaves_the_life_alone(s: Stream) -> None:
    store = run([*s.messages, s.send(A, Heartbeat(0, 1000, 1, 0))], MemoryStore())
    before = store.lives[A]
    bad = s.send(A, Heartbeat(0, 1000, 2, -1), time_ms=2_000_000_000_000)
    run([bad], store)
    assert store.lives[A] == before
    [(rejection, _)] = [store.rejected[(bad.topic, bad.partition, bad.offset)]]
    assert (rejection.reason, rejection.detail) == ("invalid_event", "negative requests_waiting -1")


def test_the_log_time_is_the_record_timestamp_when_there_is_one(s: Stream) -> None:
    store = run(s.messages, MemoryStore())
    beat = s.send(A, Heartbeat(group_idx=0))
    stamped = dataclasses.replace(beat, timestamp_ms=2_100_000_000_000)
    run([stamped], store)
    assert store.lives[A].last_seen == datetime.fromtimestamp(2_100_000_000, tz=UTC)


def test_a_stale_epoch_does_not_count_as_alive(s: Stream) -> None:
    store = run(s.messages, MemoryStore())
    run([s.send(A, Heartbeat(group_idx=0), epoch=2)], store)
    seen = store.lives[A].last_seen
    zombie = s.send(A, Heartbeat(group_idx=0), epoch=1, seq=50, time_ms=2_200_000_000_000)
    run([zombie], store)
    assert store.lives[A].last_seen == seen
    assert store.rejected[(zombie.topic, 0, zombie.offset)][0].reason == "stale_epoch"


def test_an_old_contract_producer_still_applies() -> None:
    old = Codec(schema_json=released_schemas()[0])
    new = Codec()
    assert old.fingerprint != new.fingerprint

    def message(offset: int, seq: int, event: object, epoch: int = 1) -> Inbound:
        env = Envelope(A, MODEL, 0, epoch, seq, 1_764_000_000_000 + offset, event)  # type: ignore[arg-type]
        return Inbound("old", 0, offset, message_key(A, 0), old.encode(env))

    store = MemoryStore()
    batch = [
        message(0, 0, spec(0)),
        message(1, 1, stored([1], medium="CPU")),
        message(2, 2, stored([2], medium="STORAGE", ownership="disk")),
        message(3, 0, spec(0), epoch=2),  # a restart, with the default policy
    ]
    run_batch(batch, new, store, "g")
    assert {r.status for r in store.events.values()} == {"applied"}
    assert held(store) == {(2, "STORAGE", 0)}
    assert store.sources[next(iter(store.sources))].surviving_media is None


def test_a_source_that_changes_model_keeps_the_change_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    other = dataclasses.replace(spec(0), model="other-model")
    stream = Stream()
    stream.send(A, spec(0))
    stream.send(A, stored([1]))
    stream.send(A, other, model="other-model")
    stream.send(A, other, model="other-model")
    store = run(stream.messages[:2], MemoryStore())
    assert store.lives[A].previous_model is None
    with caplog.at_level("WARNING", logger="kvledger.consumer.pipeline"):
        run(stream.messages[2:3], store)
    life = store.lives[A]
    assert (life.model, life.previous_model) == ("other-model", MODEL)
    assert life.model_changed_at is not None
    assert [r.getMessage() for r in caplog.records] == [
        f"source {A} changed model from {MODEL} to other-model: one source id per engine and "
        "model (`kvledger sources` shows the change)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvledger.consumer.pipeline"):
        run(stream.messages[3:], store)  # the new model again: no new change
    assert store.lives[A].model_changed_at == life.model_changed_at and not caplog.records


def test_a_time_in_ms_is_exact_after_2033() -> None:
    """Through a float of seconds, times after 2033 could come back a µs off their ms."""
    from kvledger.consumer.core.lifecycle import utc

    for ms in (0, 1_764_000_000_123, 2_000_000_000_001, 9_999_999_999_999, 253_402_300_799_999):
        when = utc(ms)
        assert when.tzinfo is UTC and when.microsecond % 1000 == 0
        assert (when - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() * 1000 == pytest.approx(ms)
        assert when.timestamp() * 1000 == pytest.approx(ms, abs=0.5)
    assert utc(9_999_999_999_999).microsecond == 999_000
