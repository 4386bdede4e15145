"""The sequence rule: where a message stands in its source's stream (pure).

Sequence numbers count per (source, model, group) within one producer epoch; a new epoch
restarts them at 0. For each message, against the stream's state:

- no state yet: the first message; a first seq above 0 is a gap of that many messages;
- an older epoch: ``stale`` (the source has restarted since; rejected, kept replayable);
- a newer epoch: a restart (counted); a first seq above 0 is a gap;
- same epoch, seq at or below the last: ``duplicate`` (a re-delivery; skipped, audited);
- same epoch, seq past last + 1: a gap of the numbers in between (counted, applied);
- same epoch, seq more than ``MAX_JUMP`` past the last: ``jump`` (rejected, the state does
  not move). No producer loses a million messages of one stream and goes on; a number that
  far ahead would make every later normal number look like a duplicate and silence the
  source.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from kvledger.consumer.core.model import SourceState

MAX_JUMP = 1_000_000


class Verdict(StrEnum):
    OK = "ok"
    GAP = "gap"  # applied; the state counts the missing messages
    DUPLICATE = "duplicate"
    STALE = "stale"
    JUMP = "jump"  # rejected; the state is unchanged


def advance(
    state: SourceState | None, epoch: int, seq: int, when: datetime, in_place: bool = False
) -> tuple[Verdict, SourceState | None]:
    """The verdict for one message and the stream's next state (None: unchanged).

    ``state`` is not mutated unless ``in_place`` (for a caller that owns its copy, as the
    planner does within a batch): a changed state is otherwise a new value.
    """
    if state is None:
        first = SourceState(epoch=epoch, last_seq=seq, last_event_time=when)
        if seq != 0:
            first.gap_count, first.missing_events = 1, seq
            return Verdict.GAP, first
        return Verdict.OK, first
    if in_step(state, epoch, seq):  # the usual case: the stream only moves on
        nxt = state if in_place else state.copy()
        verdict = Verdict.GAP if forward(nxt, seq) else Verdict.OK
        last = nxt.last_event_time
        nxt.last_event_time = when if last is None else max(last, when)
        return verdict, nxt
    if epoch < state.epoch:
        return Verdict.STALE, None
    if epoch == state.epoch and seq > state.last_seq + MAX_JUMP:
        return Verdict.JUMP, None
    nxt = state if in_place else state.copy()
    verdict = Verdict.OK
    if epoch > state.epoch:
        nxt.epoch_changes += 1
        nxt.epoch = epoch
        if seq != 0:
            nxt.gap_count += 1
            nxt.missing_events += seq
            verdict = Verdict.GAP
    elif seq <= state.last_seq:
        nxt.duplicates += 1
        return Verdict.DUPLICATE, nxt
    elif forward(nxt, seq):
        verdict = Verdict.GAP
    nxt.last_seq = seq
    last = nxt.last_event_time
    nxt.last_event_time = when if last is None else max(last, when)
    return verdict, nxt


def in_step(state: SourceState | None, epoch: int, seq: int) -> bool:
    """Whether a message only moves its stream on: the stream's current epoch, past its
    last number, within ``MAX_JUMP`` (``advance`` then does :func:`forward` and no more; the
    router's fast lane takes such a message straight to its group)."""
    return (
        state is not None
        and epoch == state.epoch
        and state.last_seq < seq <= state.last_seq + MAX_JUMP
    )


def forward(state: SourceState, seq: int) -> bool:
    """Move a stream to ``seq``, past its last in the same epoch (``advance``'s usual case,
    its time left to the caller): whether that skipped numbers (a gap, counted)."""
    gap = seq > state.last_seq + 1
    if gap:
        state.gap_count += 1
        state.missing_events += seq - state.last_seq - 1
    state.last_seq = seq
    return gap
