"""The relay's reading of an engine's batch numbers (pure).

An engine numbers its batches 0, 1, 2, … per process; nothing else on the wire marks a new
process, and replayed and live batches overlap. Against the last batch relayed, a batch is:

- ``NEXT``: the one after it;
- ``GAP``: further on (the batches between were missed: ask the engine to replay them);
- ``RESTART``: a number not beyond the last, with a time newer than every batch relayed
  from this process: a new engine process, whose numbers started again at 0;
- ``DUPLICATE``: any other number not beyond the last: one already relayed (a replay/live
  overlap, same time) or a stale copy of one accounted for (live batches still queued from
  before a replay, or from a range recorded lost).
"""

from __future__ import annotations

from collections import OrderedDict
from enum import StrEnum


class Seen(StrEnum):
    NEXT = "next"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


class EngineSequence:
    """The last batch relayed and the times of recent ones (``remember`` of them)."""

    def __init__(self, remember: int = 20_000) -> None:
        self.last: int | None = None
        self._times: OrderedDict[int, int] = OrderedDict()
        self._remember = remember
        self._before_reset: tuple[int | None, OrderedDict[int, int]] | None = None
        self.newest_ms: int | None = None  # the newest time relayed from this process

    def classify(self, seq: int, time_ms: int) -> Seen:
        last = self.last
        if last is None:
            return Seen.NEXT if seq == 0 else Seen.GAP
        if seq == last + 1:
            return Seen.NEXT
        if seq > last + 1:
            return Seen.GAP
        if self._times.get(seq) == time_ms:
            return Seen.DUPLICATE
        newest = self.newest_ms
        return Seen.RESTART if newest is None or time_ms > newest else Seen.DUPLICATE

    def time_of(self, seq: int) -> int | None:
        """The time of a batch relayed recently (None: not remembered)."""
        return self._times.get(seq)

    def relayed(self, seq: int, time_ms: int | None) -> None:
        """``seq`` is relayed (its time None when unknown: never a duplicate's match)."""
        self.last = seq
        if time_ms is not None:
            self._times[seq] = time_ms
            if self.newest_ms is None or time_ms > self.newest_ms:
                self.newest_ms = time_ms
            while len(self._times) > self._remember:
                self._times.popitem(last=False)

    def skip_to(self, seq: int) -> None:
        """Batches up to ``seq`` are accounted for (relayed or recorded lost)."""
        self.last = seq

    def reset(self) -> None:
        """A new engine process: nothing of it relayed yet."""
        if self._before_reset is None:
            self._before_reset = (self.last, self._times)
        self.last = None
        self._times = OrderedDict()
        self.newest_ms = None

    def committed(self) -> None:
        """What is relayed so far is committed: a later rewind goes no further back."""
        self._before_reset = None

    def rewind(self, seq: int | None) -> None:
        """Back to the committed batch ``seq`` (after an aborted transaction)."""
        if self._before_reset is not None:
            self._times = self._before_reset[1]
            self._before_reset = None
        while self._times and (seq is None or next(reversed(self._times)) > seq):
            self._times.popitem(last=True)
        self.last = seq
        self.newest_ms = max(self._times.values(), default=None)
