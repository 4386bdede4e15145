"""Reference counts and history intervals (consumer.core.refs, the compiled core's
Residencies), on a hand-made snapshot."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kvledger.consumer.core.compact import micros
from kvledger.consumer.core.model import (
    HolderScope,
    Plan,
    Residency,
    ResidencyDelta,
    ResidencyKey,
    Snapshot,
)
from kvledger.consumer.core.refs import References
from kvledger.consumer.inbound import Inbound

T = datetime(2026, 11, 30, tzinfo=UTC)
MSG = Inbound("t", 3, 42, None, b"")


def key(x: int, medium: str = "CPU", instance: str = "a") -> ResidencyKey:
    return ResidencyKey("m", 0, bytes([x]), instance, medium, "")


def deltas(refs: References) -> dict[ResidencyKey, ResidencyDelta]:
    return {d.key: d for d in Plan(refs=refs.native).residencies}


def snapshot() -> Snapshot:
    """Instance a holds block 1 twice on CPU (since T) and block 2 on GPU."""
    held = {
        key(1): Residency(2, None, T, "t", 0, 7),
        key(2, "GPU"): Residency(1, None, T, "t", 0, 8),
    }
    by_holder = {key(1).holder: {bytes([1])}, key(2, "GPU").holder: {bytes([2])}}
    return Snapshot({}, {}, held, by_holder, {}, {})


def test_counts_open_and_close_intervals_without_touching_the_snapshot() -> None:
    snap = snapshot()
    refs = References(snap)
    three = (bytes([3]),)
    assert refs.store(key(3).holder, three, micros(T), "LOCAL", MSG, False) == 0
    assert refs.remove(key(3).holder, three, T + timedelta(seconds=1), None, MSG) == 0
    assert refs.remove(key(3).holder, three, T, None, MSG) == 1  # nothing left: a no-op
    [opened] = deltas(refs)[key(3)].intervals
    assert (opened.stored_at, opened.removed_at, opened.removed_by) == (
        T, T + timedelta(seconds=1), "removed",
    )  # fmt: skip
    assert (opened.locality, opened.partition, opened.offset) == ("LOCAL", 3, 42)
    refs.remove(key(1).holder, (bytes([1]),), T, None, MSG)
    assert deltas(refs)[key(1)].refcount == 1 and snap.residencies[key(1)].refcount == 2
    assert deltas(refs)[key(1)].close_existing_at is None
    # A source that reports reused blocks as stores: one it holds gains no reference.
    assert refs.store(key(1).holder, (bytes([1]), bytes([4])), micros(T), None, MSG, True) == 1
    assert (deltas(refs)[key(1)].refcount, deltas(refs)[key(4)].refcount) == (1, 1)


def test_an_interval_opened_earlier_is_closed_by_time_and_reason() -> None:
    refs = References(snapshot())
    later = T + timedelta(minutes=1)
    ended = refs.end(refs.live(HolderScope("m", None, "a", None, None)), "restart", later, MSG)
    assert ended == {"CPU": 1, "GPU": 1}
    delta = deltas(refs)[key(1)]
    assert (delta.before, delta.refcount, delta.existed) == (2, 0, True)
    assert (delta.close_existing_at, delta.close_existing_by) == (later, "restart")
    assert refs.live(HolderScope("m", None, "a", None, None)) == []


def test_scopes_pick_holders() -> None:
    refs = References(snapshot())
    refs.store(key(5, instance="b").holder, (bytes([5]),), micros(T), None, MSG, False)
    assert refs.live(HolderScope("m", 0, "a", "GPU", "")) == [key(2, "GPU")]
    assert refs.live(HolderScope("m", None, "b", None, None)) == [key(5, instance="b")]
    assert refs.live(HolderScope("other", None, "a", None, None)) == []
