"""The sequence rule (consumer.core.sequence), value by value."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from kvledger.consumer.core.model import SourceState
from kvledger.consumer.core.sequence import Verdict, advance

T = datetime(2026, 11, 30, tzinfo=UTC)


def state(**kw: object) -> SourceState:
    return replace(SourceState(epoch=5, last_seq=10, last_event_time=T), **kw)  # type: ignore[arg-type]


def test_the_first_message_of_a_stream() -> None:
    assert advance(None, 5, 0, T) == (Verdict.OK, SourceState(5, 0, last_event_time=T))
    verdict, first = advance(None, 5, 3, T)
    assert verdict is Verdict.GAP and first is not None
    assert (first.gap_count, first.missing_events, first.last_seq) == (1, 3, 3)


def test_the_next_number_moves_on_and_keeps_the_latest_time() -> None:
    verdict, nxt = advance(state(), 5, 11, T - timedelta(seconds=1))
    assert verdict is Verdict.OK and nxt == state(last_seq=11)


def test_a_skip_is_a_gap_of_the_numbers_in_between() -> None:
    verdict, nxt = advance(state(), 5, 14, T)
    assert verdict is Verdict.GAP and nxt == state(last_seq=14, gap_count=1, missing_events=3)


def test_a_number_already_seen_is_a_duplicate() -> None:
    for seq in (10, 3):
        verdict, nxt = advance(state(), 5, seq, T)
        assert verdict is Verdict.DUPLICATE and nxt == state(duplicates=1)


def test_epochs() -> None:
    assert advance(state(), 4, 11, T) == (Verdict.STALE, None)
    verdict, nxt = advance(state(), 6, 0, T)
    assert verdict is Verdict.OK and nxt == state(epoch=6, last_seq=0, epoch_changes=1)
    verdict, nxt = advance(state(), 6, 2, T)
    assert verdict is Verdict.GAP
    assert nxt == state(epoch=6, last_seq=2, epoch_changes=1, gap_count=1, missing_events=2)


def test_the_given_state_is_never_changed() -> None:
    before = state()
    advance(before, 5, 20, T)
    advance(before, 6, 0, T)
    assert before == state()
