"""The index rules of the pure core (consumer.core.plan), run through the memory store.

No broker, no database: messages are built in memory, planned by the core, and applied by
the memory store (which the store suite checks against PostgreSQL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from kvledger.consumer.core.model import BlockKey, ResidencyKey, SourceKey
from kvledger.consumer.core.needs import needs
from kvledger.consumer.core.plan import make_plan
from kvledger.consumer.inbound import Inbound, decode
from kvledger.consumer.pipeline import BatchResult, replay_batch, run_batch
from kvledger.schemas.codec import SINGLE_OBJECT_MAGIC
from kvledger.schemas.events import EventsLost, GroupSpec, Heartbeat, KVEvent
from tests.helpers import streams
from tests.helpers.memory_store import MemoryStore
from tests.helpers.streams import MODEL, Stream, cleared, h, removed, spec, stored

A, B = "engine-a", "engine-b"


def run(
    messages: Sequence[Inbound], store: MemoryStore | None = None, batch: int = 1000
) -> tuple[MemoryStore, list[BatchResult]]:
    store = store or MemoryStore()
    results = [
        run_batch(messages[i : i + batch], Stream().codec, store, "g")
        for i in range(0, len(messages), batch)
    ]
    return store, results


def res(
    x: int, source: str = A, medium: str = "CPU", group: int = 0, own: str = ""
) -> ResidencyKey:
    return ResidencyKey(MODEL, group, h(x), source, medium, own)


def statuses(store: MemoryStore) -> list[tuple[str, str | None]]:
    return [(row.status, row.reason) for row in store.events.values()]


def history(store: MemoryStore, key: ResidencyKey) -> list[tuple[object, ...]]:
    return [(r.stored_at, r.removed_at, r.removed_by) for r in store.history if r.key == key]


@pytest.fixture
def s() -> Stream:
    stream = Stream()
    stream.send(A, spec(0))
    stream.send(B, spec(0))
    return stream


# ---------------------------------------------------------------------- reference counting
@pytest.mark.parametrize("batch", [1, 2, 1000])
def test_references_count_and_history_opens_at_one_and_closes_at_zero(
    s: Stream, batch: int
) -> None:
    s.send(A, stored([1]))
    s.send(A, stored([1]))  # the same hash announced again: a second reference
    s.send(A, removed([1]))
    store, _ = run(s.messages, batch=batch)
    assert store.residencies[res(1)].refcount == 1
    last = s.send(A, removed([1]))
    noop = s.send(A, removed([1]))  # nothing left: a recorded no-op, never a negative count
    store, _ = run(s.messages, batch=batch)
    assert res(1) not in store.residencies
    [(stored_at, removed_at, how)] = history(store, res(1))
    assert how == "removed" and stored_at < removed_at
    assert store.events[(last.topic, 0, last.offset)].noop_count == 0
    assert store.events[(noop.topic, 0, noop.offset)][12:15] == (1, "applied", "noop_removal")
    assert store.blocks[BlockKey(MODEL, 0, h(1))].token_ids == (100, 101, 102, 103)


def test_a_residency_keeps_the_message_that_opened_it(s: Stream) -> None:
    opened = s.send(A, stored([1]))
    s.send(A, stored([1]))
    store, _ = run(s.messages)
    held = store.residencies[res(1)]
    assert (held.refcount, held.offset) == (2, opened.offset)


@pytest.mark.parametrize("batch", [1, 1000])
def test_a_source_that_reports_reuse_adds_no_copy_for_a_block_it_holds(batch: int) -> None:
    """vLLM's kv_cache_report_mode="full" re-announces reused prefix blocks as stores, in
    the shape of a real store: for a source that says so, a store of a block it already
    holds on that medium is a report (audited, counted), and one removal ends the holder.
    The same bytes from a source that does not say so are a second copy."""
    s = Stream()
    s.send(A, dataclasses.replace(spec(0), reports_reuse=True))
    s.send(B, spec(0))
    for source in (A, B):
        s.send(source, stored([1, 2], medium="GPU"))
    reports = [s.send(source, stored([1, 2, 3], medium="GPU")) for source in (A, B)]
    for source in (A, B):
        s.send(source, removed([1, 2, 3], medium="GPU"))
    store, results = run(s.messages, batch=batch)
    assert set(store.residencies) == {res(1, B, "GPU"), res(2, B, "GPU")}
    # Block 3 was new to A: its store opened a holder, which its removal ended.
    assert [how for *_, how in history(store, res(3, A, "GPU"))] == ["removed"]
    report_a, report_b = (store.events[(r.topic, 0, r.offset)] for r in reports)
    assert report_a[12:15] == (2, "applied", "reported_reuse")
    assert report_b[12:15] == (0, "applied", None)
    assert sum(r.plan.reported_reuse for r in results) == 2
    assert store.sources[SourceKey(A, MODEL, 0)].reports_reuse
    assert not store.sources[SourceKey(B, MODEL, 0)].reports_reuse
    # A later announcement without the flag (the engine restarted in incremental mode)
    # makes the next store of a held block a copy again.
    s.send(A, stored([7], medium="GPU"))
    s.send(A, spec(0))
    s.send(A, stored([7], medium="GPU"))
    store, _ = run(s.messages, batch=batch)
    assert store.residencies[res(7, A, "GPU")].refcount == 2


def test_holders_are_counted_per_medium_and_ownership(s: Stream) -> None:
    s.send(A, stored([1], medium="CPU"))
    s.send(A, stored([1], medium="STORAGE", ownership="disk"))
    s.send(B, stored([1], medium=None))  # absent medium means GPU
    s.send(A, removed([1], medium="CPU"))
    store, _ = run(s.messages)
    assert set(store.residencies) == {res(1, A, "STORAGE", own="disk"), res(1, B, "GPU")}


# ---------------------------------------------------------------------- sequence
def test_a_redelivered_message_is_a_duplicate_and_changes_nothing(s: Stream) -> None:
    s.send(A, stored([1]), seq=1)  # seq 0 was the group announcement
    s.send(A, stored([1]), seq=1)
    store, results = run(s.messages)
    assert store.residencies[res(1)].refcount == 1
    assert statuses(store)[-1] == ("duplicate", None)
    assert store.sources[SourceKey(A, MODEL, 0)].duplicates == 1
    assert results[0].plan.duplicates == 1
    # Kept with its bytes like a rejection, and replayable only when asked for by name.
    [(kept, replayed)] = store.rejected.values()
    assert (kept.reason, kept.message.value, replayed) == ("duplicate", s.messages[-1].value, False)


def test_gaps_are_counted_and_applied(s: Stream) -> None:
    s.send(A, stored([1]), seq=1)
    s.send(A, stored([2]), seq=5)
    store, results = run(s.messages)
    state = store.sources[SourceKey(A, MODEL, 0)]
    assert (state.gap_count, state.missing_events, state.last_seq) == (1, 3, 5)
    assert results[0].plan.gaps == 1
    assert {res(1), res(2)} <= set(store.residencies)


def test_a_new_epoch_restarts_the_count_and_an_older_one_is_stale(s: Stream) -> None:
    s.send(A, stored([1]), epoch=1)
    s.send(A, stored([2]), epoch=2, seq=0)
    stale = s.send(A, stored([3]), epoch=1, seq=1)
    store, _ = run(s.messages)
    state = store.sources[SourceKey(A, MODEL, 0)]
    assert (state.epoch, state.epoch_changes, state.last_seq) == (2, 1, 0)
    assert res(3) not in store.residencies
    rejection, _ = store.rejected[(stale.topic, stale.partition, stale.offset)]
    assert rejection.reason == "stale_epoch" and rejection.message.value == stale.value


def test_a_first_message_after_zero_is_a_gap(s: Stream) -> None:
    s.send("engine-c", stored([1]), seq=4)
    store, _ = run(s.messages)
    state = store.sources[SourceKey("engine-c", MODEL, 0)]
    assert (state.gap_count, state.missing_events) == (1, 4)


# ---------------------------------------------------------------------- rejections
def rejected(store: MemoryStore) -> list[str]:
    return [r.reason for r, _ in store.rejected.values()]


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (stored([1], group=7), "unknown_group"),
        (removed([1], group=7), "unknown_group"),
        (stored([1], size=8), "block_size_mismatch"),
        (stored([1], size=2, partial=True), "block_size_mismatch"),
        (stored([1], medium="TAPE"), "invalid_event"),
        (removed([], medium="CPU"), "invalid_event"),
        (cleared(medium="TAPE"), "invalid_event"),
    ],
)
def test_each_shape_rejection_has_its_reason(s: Stream, event: KVEvent, reason: str) -> None:
    s.send(A, event)
    store, _ = run(s.messages)
    assert rejected(store) == [reason]
    assert statuses(store)[-1] == ("rejected", reason)
    assert not store.residencies


def test_token_count_and_placeholder_rejections(s: Stream) -> None:
    bad_count = stored([1, 2])
    bad_count = type(bad_count)(**{**_fields(bad_count), "token_ids": bad_count.token_ids[:5]})
    placeholder = type(bad_count)((h(9),), None, (), 0, None, "CPU", None, group_idx=0)
    s.send(A, bad_count)
    s.send(A, placeholder)
    store, _ = run(s.messages)
    assert rejected(store) == ["token_count_mismatch", "placeholder_for_full_attention"]


def _fields(event: object) -> dict[str, object]:
    return {name: getattr(event, name) for name in event.__slots__}  # type: ignore[attr-defined]


def test_undecodable_and_unknown_schema_are_rejected_with_their_bytes(s: Stream) -> None:
    garbage = s.raw(b"\x01\x02garbage")
    unknown = s.raw(SINGLE_OBJECT_MAGIC + b"\x00" * 8 + b"\x02")
    store, _ = run(s.messages)
    assert rejected(store) == ["undecodable", "unknown_schema"]
    assert store.rejected[(garbage.topic, 0, garbage.offset)][0].message.value == garbage.value
    assert store.events[(unknown.topic, 0, unknown.offset)].source is None


def test_announcements_conflicting_with_a_declared_spec_are_rejected() -> None:
    s = Stream()
    s.send(A, spec(0, block=8, hash_size=4))
    s.send(A, GroupSpec("other-model", 0, "full_attention", 4, 4))  # not its model
    s.send(A, stored([1], size=4))
    store = MemoryStore()
    store.declare(spec(0, block=4, hash_size=4))
    run(s.messages, store)
    assert rejected(store) == ["spec_conflict", "invalid_event"]
    assert store.residencies[res(1)].refcount == 1


# ---------------------------------------------------------------------- conflicts
def test_a_hash_conflict_rejects_the_whole_event_and_keeps_the_first_content(s: Stream) -> None:
    s.send(A, stored([1]))
    s.send(B, stored([5, 1], salt=1))  # hash 1 again, with other tokens
    s.send(B, stored([1], start=4))  # same tokens at another position
    store, _ = run(s.messages)
    assert rejected(store) == ["hash_conflict", "hash_conflict"]
    assert set(store.residencies) == {res(1)}
    assert BlockKey(MODEL, 0, h(5)) not in store.blocks
    assert store.blocks[BlockKey(MODEL, 0, h(1))].token_ids == (100, 101, 102, 103)


# ---------------------------------------------------------------------- placeholders, tails
def test_placeholders_are_upgraded_by_real_rows() -> None:
    s = Stream()
    s.send(A, spec(1, kind="sliding_window"))
    placeholder = stored([1], group=1)
    placeholder = type(placeholder)((h(1),), None, (), 0, None, "CPU", None, group_idx=1)
    s.send(A, placeholder)
    s.send(B, stored([1], group=1, start=8))
    store, _ = run(s.messages)
    row = store.blocks[BlockKey(MODEL, 1, h(1))]
    assert (row.block_size, row.token_start) == (4, 8)
    assert store.residencies[res(1, A, group=1)].refcount == 1


def test_partial_tails_use_the_hash_size_and_give_way_to_full_blocks() -> None:
    s = Stream()
    s.send(A, spec(0, block=8, hash_size=4))
    tail = stored([1], size=4, partial=True, start=4)
    s.send(A, tail)  # a tail hash that ends at token 8, as the full block does
    full = stored([1], size=8, start=0)
    full = type(full)(**{**_fields(full), "token_ids": (0, 0, 0, 0, *tail.token_ids)})
    s.send(B, full)
    s.send(B, stored([1], size=4, partial=True, start=8))  # ends elsewhere: a conflict
    store, _ = run(s.messages)
    row = store.blocks[BlockKey(MODEL, 0, h(1))]
    assert (row.block_size, row.partial, row.token_start) == (8, False, 0)
    assert rejected(store) == ["hash_conflict"]
    assert {res(1, A), res(1, B)} == set(store.residencies)


# ---------------------------------------------------------------------- positions (vLLM)
def test_an_event_without_position_starts_at_the_root_or_where_its_parent_ends(
    s: Stream,
) -> None:
    s.send(A, stored([1, 2], start=None))  # no parent: the sequence's start
    s.send(A, stored([3], start=None, parent=2))  # after its parent's row
    s.send(A, stored([8], start=None, parent=7))  # parent never seen: unknown
    store, _ = run(s.messages, batch=1)
    starts = {x: store.blocks[BlockKey(MODEL, 0, h(x))].token_start for x in (1, 2, 3, 8)}
    assert starts == {1: 0, 2: 4, 3: 8, 8: None}
    run([s.send(A, stored([8], start=12, parent=7))], store)  # a later event that knows it
    assert store.blocks[BlockKey(MODEL, 0, h(8))].token_start == 12
    assert rejected(store) == []


@pytest.mark.parametrize("batch", [1, 1000])
def test_lora_name_does_not_depend_on_which_events_share_a_batch(s: Stream, batch: int) -> None:
    s.send(A, spec(1, kind="sliding_window"))
    placeholder = stored([50], group=1)
    s.send(A, type(placeholder)((h(50),), None, (), 0, None, "CPU", None, group_idx=1))
    s.send(B, stored([50], group=1, lora="adapter-x"))
    store, _ = run(s.messages, batch=batch)
    assert store.block_meta[BlockKey(MODEL, 1, h(50))].lora_name == "adapter-x"


# ---------------------------------------------------------------------- AllBlocksCleared
def test_all_blocks_cleared_ends_every_reference_of_that_medium(s: Stream) -> None:
    s.send(A, spec(1, kind="full_attention"))
    s.send(A, stored([1, 2]))
    s.send(A, stored([1]))
    s.send(A, stored([3], group=1))
    s.send(A, stored([4], medium="GPU"))
    s.send(A, stored([5], ownership="disk"))
    s.send(B, stored([1]))
    s.send(A, cleared(medium="CPU"))  # every group of the model, every ownership
    store, _ = run(s.messages)
    assert set(store.residencies) == {res(4, medium="GPU"), res(1, B)}
    assert history(store, res(1))[0][2] == "cleared"
    assert history(store, res(5, own="disk"))[0][2] == "cleared"
    assert store.events[max(store.events)].hash_count == 4


def test_events_lost_ends_every_tier_and_ownership_of_the_group_and_records_the_range(
    s: Stream,
) -> None:
    s.send(A, spec(1))
    s.send(A, stored([1]))
    s.send(A, stored([2], medium="GPU"))
    s.send(A, stored([3], medium="STORAGE", ownership="disk"))
    s.send(A, stored([4], group=1))
    s.send(B, stored([1]))
    store, _ = run(s.messages)
    run([s.send(A, EventsLost(10, 14, group_idx=0))], store)
    assert set(store.residencies) == {res(4, group=1), res(1, B)}
    assert history(store, res(3, medium="STORAGE", own="disk"))[0][2] == "lost"
    [event] = [e for e in store.lifecycle if e.kind == "lost"]
    assert (event.group_idx, event.first_lost_seq, event.last_lost_seq) == (0, 10, 14)
    assert (event.ended_gpu, event.ended_cpu, event.ended_storage) == (1, 1, 1)
    state = store.sources[SourceKey(A, MODEL, 0)]
    assert (state.lost_gaps, state.lost_batches) == (1, 5)
    run([s.send(A, EventsLost(20, 19, group_idx=0))], store)  # a loss of unknown size
    assert store.sources[SourceKey(A, MODEL, 0)].lost_gaps == 2
    run([s.send(A, EventsLost(3, 1, group_idx=0))], store)
    assert statuses(store)[-1] == ("rejected", "invalid_event")


def test_a_clear_of_one_group_leaves_the_others_and_covers_earlier_batches(s: Stream) -> None:
    s.send(A, spec(1))
    s.send(A, stored([1]))
    s.send(A, stored([3], group=1))
    store, _ = run(s.messages)
    run([s.send(A, cleared(group=0, medium="CPU"))], store)
    assert set(store.residencies) == {res(3, group=1)}
    [(_, removed_at, how)] = history(store, res(1))
    assert how == "cleared" and removed_at is not None


# ---------------------------------------------------------------------- batches and replay
def test_the_index_does_not_depend_on_batch_boundaries(s: Stream) -> None:
    for i in range(12):
        s.send(A if i % 2 else B, stored([i % 5, i % 5 + 10], salt=0))
        s.send(A, removed([i % 3]))
        if i == 7:
            s.send(B, cleared())
    dumps = [run(s.messages, batch=size)[0].dump() for size in (1, 3, 1000)]
    assert dumps[0] == dumps[1] == dumps[2]


def test_the_snapshot_is_never_changed_by_planning(s: Stream) -> None:
    s.send(A, stored([1]))
    store, _ = run(s.messages)
    more = [s.send(A, stored([1])), s.send(A, removed([1])), s.send(A, removed([1]))]
    before = store.dump()
    batch = [decode(m, s.codec) for m in more]
    plan = make_plan(batch, store.load(needs(batch)))
    assert store.dump() == before
    assert [(d.before, d.refcount, d.existed) for d in plan.residencies] == [(1, 0, True)]
    assert plan.residencies[0].close_existing_by == "removed"


def test_a_fixed_rejection_replays_once(s: Stream) -> None:
    store = MemoryStore()
    early = s.send(A, stored([1], group=3))  # unknown group until declared
    run(s.messages, store)
    store.declare(spec(3))
    batch = [decode(early, s.codec)]
    assert replay_batch(batch, store).replayed == 1
    assert store.events[(early.topic, 0, early.offset)].reason == "replayed"
    assert store.rejected[(early.topic, 0, early.offset)][1] is True
    assert store.residencies[res(1, group=3)].refcount == 1


def test_a_replayed_store_whose_removal_came_first_leaves_no_phantom_holder(s: Stream) -> None:
    """A store refused (its size disagreed with the announced spec), its removal applied as a
    no-op, the spec fixed, the store replayed: its block is written, no holder is added (the
    removal may have been its own); a refused store with no removal after it replays fully."""
    refused = s.send(A, stored([1], size=8))  # block_size_mismatch: the spec says 4
    s.send(A, removed([1]))  # no reference: a recorded no-op
    other = s.send(A, stored([2], size=8))
    store, _ = run(s.messages)
    store.declare(spec(0, block=8, hash_size=8))
    assert replay_batch([decode(refused, s.codec), decode(other, s.codec)], store).replayed == 2
    assert res(1) not in store.residencies and res(2) in store.residencies
    assert store.blocks[BlockKey(MODEL, 0, h(1))].block_size == 8
    assert store.events[(refused.topic, 0, refused.offset)].reason == "replayed_without_holders"
    assert store.events[(other.topic, 0, other.offset)].reason == "replayed"


# ---------------------------------------------------------------------- fencing
def test_a_batch_may_start_past_where_its_reading_began_but_not_past_the_store(
    s: Stream,
) -> None:
    """Between two batches a read-committed consumer skips records that are no data (a
    transaction's commit marker): the fence then expects the stored offset where the reading
    began; without that, or when another consumer moved the offset, the batch is fenced."""
    from kvledger.consumer.store.base import FencedError

    first = [s.send(A, stored([1])), s.send(A, stored([2]))]
    store, _ = run(first)
    s.raw(b"")  # offset 4: the commit marker the consumer never sees
    s.messages.pop()
    later = [s.send(A, stored([3]))]
    with pytest.raises(FencedError):
        run_batch(later, Stream().codec, store, "g")
    run_batch(later, Stream().codec, store, "g", read_from={("events", 0): 4})
    assert store.stored_offsets("g", "events") == {0: 6}
    with pytest.raises(FencedError):  # reading began before what is stored: another wrote
        run_batch([s.send(A, stored([4]))], Stream().codec, store, "g",
                  read_from={("events", 0): 5})  # fmt: skip


# ---------------------------------------------------------------------- hostile envelopes
def _env(event: KVEvent, **fields: object) -> bytes:
    from kvledger.schemas.events import Envelope

    base: dict[str, object] = {
        "source": A, "model": MODEL, "dp_rank": 0, "epoch": 1, "seq": 5,
        "event_time_ms": 1_764_000_000_000, "event": event,
    }  # fmt: skip
    base.update(fields)
    return Stream().codec.encode(Envelope(**base))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "key", "reason"),
    [
        (_env(stored([9])), b"engine-b/0", "key_mismatch"),
        (_env(stored([9], group=1)), b"engine-a/0", "key_mismatch"),
        (_env(stored([9])), None, "key_mismatch"),
        (_env(stored([9], lora="a\x00b")), b"engine-a/0", "invalid_event"),
        (_env(stored([9], ownership="x" * 5000)), b"engine-a/0", "invalid_event"),
        (_env(stored([9]), seq=-1), b"engine-a/0", "invalid_event"),
        (_env(stored([9]), event_time_ms=2**63 - 1), b"engine-a/0", "invalid_event"),
        (_env(stored([9]), event_time_ms=-(2**62)), b"engine-a/0", "invalid_event"),
        (_env(stored([9]), epoch=2**63 - 1), b"engine-a/0", "future_epoch"),
        (_env(stored([9], start=2**63 - 1)), b"engine-a/0", "invalid_event"),
        (_env(Heartbeat(group_idx=0, interval_ms=-5)), b"engine-a/0", "invalid_event"),
    ],
    ids=[
        "other source", "other group", "no key", "NUL", "long name", "negative seq",
        "time past 9999", "time before 1970", "epoch far ahead", "position past bigint",
        "negative interval",
    ],
)  # fmt: skip
def test_a_hostile_envelope_is_rejected_before_it_touches_its_stream(
    s: Stream, value: bytes, key: bytes | None, reason: str
) -> None:
    s.send(A, stored([1]))
    store, _ = run(s.messages)
    before = store.sources[SourceKey(A, MODEL, 0)].copy()
    hostile = s.raw(value, key or b"")
    if key is None:
        hostile = Inbound(hostile.topic, hostile.partition, hostile.offset, None, value)
    run([hostile], store)
    assert statuses(store)[-1] == ("rejected", reason)
    assert store.sources[SourceKey(A, MODEL, 0)] == before  # the stream did not move
    run([s.send(A, stored([2]))], store)  # the next normal message applies
    assert statuses(store)[-1] == ("applied", None)


def test_names_are_bounded_each_and_text_anywhere_may_not_hold_a_nul() -> None:
    """The check's quick path sums the names; the bound is on each one, and extra keys are
    text too."""
    from kvledger.consumer.core.validate import MAX_NAME_CHARS, check_envelope
    from kvledger.schemas.events import Envelope

    def check(event: KVEvent, source: str = A) -> str | None:
        env = Envelope(source, MODEL, 0, 1, 5, 1_764_000_000_000, event)
        invalid = check_envelope(env, f"{source}/0".encode(), None)
        return None if invalid is None else invalid.detail

    near = "x" * MAX_NAME_CHARS
    assert check(stored([9], lora=near, ownership=near), source=near) is None
    assert check(stored([9], lora=near + "x")) == (
        f"a name of {MAX_NAME_CHARS + 1} characters (at most {MAX_NAME_CHARS})"
    )
    keyed = dataclasses.replace(stored([9]), extra_keys=("salt", None, "a\x00b"))
    assert check(keyed) == "text with a NUL character: 'a\\x00b'"
    assert check(dataclasses.replace(stored([9]), extra_keys=("salt", "y" * 5000))) is None
    assert check(stored([9]), source="engine\x00a") == "text with a NUL character: 'engine\\x00a'"


def test_a_number_far_ahead_cannot_silence_a_source(s: Stream) -> None:
    s.send(A, stored([1]))
    store, _ = run(s.messages)
    run([s.send(A, stored([2]), seq=2**62)], store)
    assert statuses(store)[-1] == ("rejected", "sequence_jump")
    run([s.send(A, stored([3]), seq=2)], store)  # the next normal number still applies
    assert statuses(store)[-1] == ("applied", None)
    assert store.sources[SourceKey(A, MODEL, 0)].last_seq == 2


def test_an_unknown_group_is_named_with_the_wire_default() -> None:
    """An event of the old contract (no group_idx) is group 0, and the detail says so."""
    from kvledger.consumer.core.validate import check_removed, check_stored
    from kvledger.schemas.events import BlockRemoved, BlockStored

    stored_event = BlockStored((b"\x01" * 8,), None, (1, 2, 3, 4), 4, None, "GPU", None)
    removed_event = BlockRemoved((b"\x01" * 8,), "GPU")
    for invalid in (check_stored(stored_event, None), check_removed(removed_event, None)):
        assert invalid is not None and invalid.detail.startswith("group 0 has no declared")
        assert "kvledger groups declare" in invalid.detail


# ---------------------------------------------------------------------- 0.34 state checkpoints
def checkpoint(x: int, parent: int | None, size: int = 4, group: int = 1, hashes: int = 1,
               partial: bool = False) -> KVEvent:  # fmt: skip
    return streams.checkpoint(x, parent=parent, size=size, group=group, partial=partial,
                              hashes=hashes)  # fmt: skip


def test_a_state_checkpoint_is_a_block_of_a_recurrent_group(s: Stream) -> None:
    s.send(A, spec(1, "mamba", 8, 4))
    s.send(A, stored([1, 2, 3, 4]))  # the attention group's blocks
    s.send(A, checkpoint(2, parent=1, size=8))  # the state after the chunk ending at 2
    s.send(A, checkpoint(4, parent=3, size=4, partial=True))  # a partial tail's state
    s.send(A, removed([2], group=1))
    store, _ = run(s.messages)
    assert rejected(store) == []
    row = store.blocks[BlockKey(MODEL, 1, h(4))]
    assert (row.parent_hash, row.token_ids, row.block_size, row.partial) == (h(3), (), 4, True)
    assert store.blocks[BlockKey(MODEL, 1, h(2))].parent_hash == h(1)
    assert res(4, group=1) in store.residencies
    assert res(2, group=1) not in store.residencies  # held, then removed: in the history
    [(_, removed_at, how)] = history(store, res(2, group=1))
    assert how == "removed" and removed_at is not None


@pytest.mark.parametrize(
    ("event", "reason", "names"),
    [
        (checkpoint(2, parent=1, group=0), "token_count_mismatch", "a recurrent group"),
        (checkpoint(2, parent=1, hashes=2), "invalid_event", "names one hash"),
        (checkpoint(2, parent=1, size=16), "block_size_mismatch", "says 8"),
    ],
)
def test_a_state_checkpoint_that_cannot_be_one_is_rejected_saying_why(
    s: Stream, event: KVEvent, reason: str, names: str
) -> None:
    s.send(A, spec(1, "mamba", 8, 4))
    s.send(A, event)
    store, _ = run(s.messages)
    assert rejected(store) == [reason]
    [detail] = [r.detail for r, _ in store.rejected.values()]
    assert names in detail, detail


def test_the_034_trackers_checkpoints_are_indexed_as_announced(s: Stream) -> None:
    """kvledger's own tracker under vLLM 0.34's rules, into the core: accepted as they are."""
    from kvledger.producer.tracker import (
        GroupOffloadConfig,
        Medium,
        OffloadingEvent,
        OffloadingEventGroupSpec,
        OffloadingEventsTracker,
        make_offload_key,
    )

    class Req:
        block_hashes = [h(i) for i in range(16)]
        all_token_ids = list(range(64))
        lora_request = None

    tracker = OffloadingEventsTracker(vllm_version="0.34.0")
    config = GroupOffloadConfig(1, 8, 16, 4, OffloadingEventGroupSpec("mamba", None), 1)
    keys = [make_offload_key(h(4 * c + 3), 1) for c in range(4)]
    for c, key in enumerate(keys):
        tracker.record_store(Req(), config, c, key)
    tracker.record_partial_store(Req(), config, 56, make_offload_key(h(13), 1))
    events = tracker.take_events(
        [OffloadingEvent([*keys, make_offload_key(h(13), 1)], Medium.CPU, removed=False)]
    )
    s.send(A, spec(1, "mamba", 8, 4))
    for event in events:
        s.send(A, event)
    store, _ = run(s.messages)
    assert rejected(store) == []
    held = sorted(k.block_hash for k in store.residencies if k.group_idx == 1)
    assert held == [h(3), h(7), h(11), h(13), h(15)]
    assert store.blocks[BlockKey(MODEL, 1, h(7))].parent_hash == h(5)
