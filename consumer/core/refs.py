"""Reference counts and history intervals of residencies, over a snapshot (pure).

A residency exists while its reference count is above zero: a history interval opens at
0→1 and closes at 1→0 (never before it opened). A removal with no reference left is a
no-op, never a negative count. The snapshot is read, never changed. The counts and
intervals are the compiled core's (``kvledger._core.Residencies``, rust/src/plan_refs.rs):
a store or removal event is handed over whole, and the PostgreSQL store copies the result
as it is. :class:`References` gives the planner its types.
"""

from __future__ import annotations

from datetime import datetime

from kvledger.consumer.core.compact import Residencies, micros
from kvledger.consumer.core.model import (
    HolderKey,
    HolderScope,
    ResidencyKey,
    Snapshot,
    new_tuple,
)
from kvledger.consumer.inbound import Inbound


class References:
    """The batch's residencies: the snapshot's, overlaid with the batch's changes."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.native = Residencies(
            snapshot.residencies, snapshot.held, snapshot.residency_base, snapshot.history, micros
        )

    def store(  # noqa: PLR0913 - the core's Residencies.store (PyO3), argument for argument
        self,
        holder: HolderKey,
        hashes: tuple[bytes, ...],
        when_us: int,
        locality: str | None,
        msg: Inbound,
        reports_reuse: bool,
    ) -> int:
        """One reference more per hash (none for a hash the holder holds, when it reports
        reused blocks as stores); how many it held that way. ``when_us``: the event's time
        as :func:`~.compact.micros` gives it (the planner has it for the block rows too)."""
        at = (msg.topic, msg.partition, msg.offset)
        return self.native.store(holder, hashes, when_us, locality, at, reports_reuse)

    def remove(
        self,
        holder: HolderKey,
        hashes: tuple[bytes, ...],
        when: datetime,
        locality: str | None,
        msg: Inbound,
    ) -> int:
        """One reference less per hash; how many had none left (recorded no-ops)."""
        at = (msg.topic, msg.partition, msg.offset)
        return self.native.remove(holder, hashes, micros(when), locality, at)

    def live(self, scope: HolderScope) -> list[ResidencyKey]:
        """Every residency in ``scope`` with a reference, in key order."""
        found = self.native.live(
            scope.model, scope.group_idx, scope.instance, scope.medium, scope.ownership
        )
        return [new_tuple(ResidencyKey, key) for key in found]

    def end(
        self, keys: list[ResidencyKey], how: str, when: datetime, msg: Inbound
    ) -> dict[str, int]:
        """Drop every reference of ``keys`` (``how``: the history's reason); per medium."""
        return self.native.end(keys, how, micros(when), (msg.topic, msg.partition, msg.offset))
