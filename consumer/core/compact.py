"""A plan's block rows and residencies held compact by the compiled core (rust/src/
plan_rows.rs, plan_refs.rs), the times the core holds, and the plan's rows and deltas made
back into :mod:`.model`'s objects for a store that applies them one by one."""

from __future__ import annotations

from datetime import datetime, timedelta

from kvledger.consumer.core.lifecycle import UNIX_EPOCH
from kvledger.consumer.core.model import (
    BlockKey,
    BlockRow,
    BlockWrite,
    Interval,
    ResidencyDelta,
    ResidencyKey,
    new_tuple,
)
from kvledger.native import missing_core

try:
    from kvledger import _core
except ImportError as exc:  # built without a Rust toolchain: say what to do
    raise missing_core("the index's planner") from exc

# A batch's block rows and their content rules: the planner's, and ``upgrades`` the stores'
# too, where they merge a row another writer stored since the plan.
BlockRows = _core.BlockRows
upgrades = _core.upgrades
# The residencies' reference counts and history intervals a batch changes.
Residencies = _core.Residencies

_MICROSECOND = timedelta(microseconds=1)


def micros(when: datetime) -> int:
    """An aware time as µs since the Unix epoch (exact: how the compiled core holds times)."""
    return (when - UNIX_EPOCH) // _MICROSECOND


def from_micros(us: int) -> datetime:
    return UNIX_EPOCH + timedelta(microseconds=us)


def block_writes(rows: BlockRows) -> dict[BlockKey, BlockWrite]:
    """``rows`` as BlockWrites by key, in the order written."""
    return {
        new_tuple(BlockKey, key): BlockWrite(
            new_tuple(BlockRow, row), lora, extra, from_micros(first), from_micros(last), stored
        )
        for key, row, (lora, extra, first, last, stored) in rows.items()
    }


def residency_deltas(refs: Residencies) -> list[ResidencyDelta]:
    """``refs``' changed residencies as ResidencyDeltas, in the order first changed."""
    out = []
    for key, before, refcount, existed, now, close, intervals in refs.touched():
        locality, since, topic, partition, offset = now
        delta = ResidencyDelta(
            new_tuple(ResidencyKey, key),
            before,
            refcount,
            existed,
            locality,
            None if since is None else from_micros(since),
            topic,
            partition,
            offset,
            None if close is None else from_micros(close[0]),
            None if close is None else close[1],
            [
                Interval(
                    from_micros(stored),
                    where,
                    part,
                    off,
                    None if removed is None else from_micros(removed),
                    by,
                )
                for stored, where, part, off, removed, by in intervals
            ],
            True,
        )
        out.append(delta)
    return out
