"""What a batch touches (pure): the block rows, residencies, whole holders and sources the
store loads into the :class:`~.model.Snapshot` that :func:`~.plan.make_plan` walks."""

from __future__ import annotations

from collections.abc import Sequence

from kvledger.consumer.core.model import (
    PRIMARY_OWNERSHIP,
    GroupKey,
    HolderKey,
    HolderScope,
    Needs,
    SourceKey,
    new_tuple,
)
from kvledger.consumer.inbound import Decoded
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventsLost,
    Goodbye,
    group_of,
    medium_of,
)


def needs(batch: Sequence[Decoded], check_sequence: bool = True, keys: bool = True) -> Needs:  # noqa: C901 - one pass per message, a branch per event kind
    """What ``batch`` touches: the block rows, residencies, whole holders and sources.

    ``keys=False``: only a replay's stores (``Needs.replayed``), for a store that holds the
    whole index in process (it answers any key)."""
    out = Needs()
    if not keys:
        if not check_sequence:
            out.replayed = _replayed(batch)
        return out
    restarts, residencies, blocks = out.restarts, out.residencies, out.blocks
    for d in batch:
        env = d.envelope
        if env is None:
            continue
        source, model, ev = env.source, env.model, env.event
        out.sources.add(source)
        group = group_of(ev)
        stream = new_tuple(SourceKey, (source, model, group))
        if restarts.get(stream, -1) < env.epoch:
            restarts[stream] = env.epoch
        if isinstance(ev, BlockStored | BlockRemoved):
            holder = _holder(model, group, source, ev)
            hashes = residencies.get(holder)
            if hashes is None:
                hashes = residencies[holder] = set()
            hashes.update(ev.block_hashes)
            if isinstance(ev, BlockStored):
                wanted = blocks.setdefault(new_tuple(GroupKey, (model, group)), set())
                wanted.update(ev.block_hashes)
                if ev.token_start is None and ev.parent_block_hash is not None:
                    wanted.add(ev.parent_block_hash)  # its position follows the parent's
        elif isinstance(ev, AllBlocksCleared):
            out.scopes.add(HolderScope(env.model, ev.group_idx, env.source, medium_of(ev), None))
        elif isinstance(ev, EventsLost):
            out.scopes.add(HolderScope(env.model, group, env.source, None, None))
        elif isinstance(ev, Goodbye):
            out.scopes.add(HolderScope(env.model, None, env.source, None, None))
    if not check_sequence:  # a replay: no sequence, no restarts
        out.sources.clear()
        out.restarts.clear()
        out.replayed = _replayed(batch)
    return out


def _replayed(batch: Sequence[Decoded]) -> list[tuple[HolderKey, str, int, int]]:
    """A replay's stores: each one's holder and its message's coordinates."""
    out = []
    for d in batch:
        env = d.envelope
        if env is not None and isinstance(ev := env.event, BlockStored):
            m = d.message
            holder = _holder(env.model, group_of(ev), env.source, ev)
            out.append((holder, m.topic, m.partition, m.offset))
    return out


def _holder(model: str, group: int, source: str, ev: BlockStored | BlockRemoved) -> HolderKey:
    """The holder an event's blocks belong to (medium and ownership with their defaults)."""
    own = ev.ownership or PRIMARY_OWNERSHIP
    return new_tuple(HolderKey, (model, group, source, medium_of(ev), own))
