"""Reference counts and history intervals of residencies in plain Python: the oracle the
compiled core's ``Residencies`` (rust/src/plan_refs.rs) is held to by
tests/unit/test_residencies.py, as the planner made them before the core did.

A residency exists while its reference count is above zero: a history interval opens at
0→1 and closes at 1→0 (never before it opened). A removal with no reference left is a
no-op, never a negative count. The snapshot is read, never changed: each residency the
batch touches gets its own :class:`~.model.ResidencyDelta`.
"""

from __future__ import annotations

from datetime import datetime

from kvledger.consumer.core.model import (
    HolderScope,
    Interval,
    ResidencyDelta,
    ResidencyKey,
    Snapshot,
)
from kvledger.consumer.inbound import Inbound


class References:
    """The batch's residencies: the snapshot's, overlaid with the batch's changes."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snap = snapshot
        self.history = snapshot.history
        self.deltas: dict[ResidencyKey, ResidencyDelta] = {}

    def touched(self) -> list[ResidencyDelta]:
        return [d for d in self.deltas.values() if d.touched]

    def count(self, key: ResidencyKey) -> int:
        delta = self.deltas.get(key)
        if delta is not None:
            return delta.refcount
        held = self.snap.residencies.get(key)
        return held.refcount if held is not None else 0

    def live(self, scope: HolderScope) -> list[ResidencyKey]:
        """Every residency in ``scope`` with a reference, in key order."""
        keys = {
            ResidencyKey(holder.model, holder.group_idx, h, holder.instance, holder.medium,
                         holder.ownership)
            for holder, hashes in self.snap.held.items()
            if scope.covers(holder)
            for h in hashes
        }  # fmt: skip
        keys.update(k for k in self.deltas if scope.covers(k.holder))
        return sorted(k for k in keys if self.count(k) > 0)

    def end(
        self, keys: list[ResidencyKey], how: str, when: datetime, msg: Inbound
    ) -> dict[str, int]:
        """Drop every reference of ``keys`` (``how``: the history's reason); per medium."""
        ended: dict[str, int] = {}
        for key in keys:
            count = self.count(key)
            if count > 0:
                self.change(key, -count, when, None, msg, how)
                ended[key.medium] = ended.get(key.medium, 0) + 1
        return ended

    def change(
        self,
        key: ResidencyKey,
        change: int,
        when: datetime,
        locality: str | None,
        msg: Inbound,
        how: str = "removed",
    ) -> bool:
        """Change a holder's reference count; False for a removal with no reference left."""
        state = self.deltas.get(key)
        if state is None:
            state = self._delta(key)
        before = state.refcount
        if change < 0 and before == 0:
            return False
        after = state.refcount = before + change
        state.touched = True
        if before == 0:  # 0 -> n: a residency and its history interval open
            state.locality, state.since = locality, when
            state.topic, state.partition, state.offset = msg.topic, msg.partition, msg.offset
            if self.history:
                state.intervals.append(Interval(when, locality, msg.partition, msg.offset))
        elif after == 0 and self.history:  # n -> 0: they end
            opened = next((i for i in state.intervals if i.removed_at is None), None)
            if opened is not None:
                opened.removed_at = max(when, opened.stored_at)
                opened.removed_by = how
            else:  # the interval was opened by an earlier batch
                state.close_existing_at = when
                state.close_existing_by = how
        return True

    def _delta(self, key: ResidencyKey) -> ResidencyDelta:
        """The key's delta, created from the snapshot on first touch."""
        held = self.snap.residencies.get(key)
        if held is None:
            delta = ResidencyDelta(key, 0, 0, False)
        else:
            delta = ResidencyDelta(
                key, held.refcount, held.refcount, True, held.locality, held.since,
                held.topic, held.partition, held.offset,
            )  # fmt: skip
        self.deltas[key] = delta
        return delta
