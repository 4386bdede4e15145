"""The router's batch: the pipeline's, with the commonest events applied in one native call.

A router tails what a whole fleet stores and removes. Through the pure core
(:func:`~kvledger.consumer.pipeline.run_batch`) each block of each event becomes several
Python objects (a row, a write, a residency delta) that the store then reads back; that
cost, not the index, bounds how fast a router keeps up. So :func:`run_router_batch` reads a
batch in order and takes each store or removal event whose rules come down to "add these
blocks' rows and references" or "take these references away" straight to its group
(``store_run`` / ``release_run``: rust/src/group/events.rs, pure twin
tests/helpers/pure_router/event_runs.py). That is an event that:

- is valid as :func:`~kvledger.consumer.core.validate.check_envelope` and
  ``check_stored`` / ``check_removed`` say, with no extra keys;
- comes next in its stream's epoch (no first message, no restart, no duplicate or jump:
  a gap is counted, as the rules count it);
- from a source whose life says nothing new (known, not closed, the same model and no
  newer epoch), a holder and group the store knows;
- and, for a store, only blocks new to the group or stored with exactly this content (a
  placeholder's blocks keep whatever their rows hold).

Every other message (announcements, heartbeats, clears, losses, goodbyes, rejections and
whatever an event's group declines) goes through the pure core's planner, consecutive ones
together, applied before the next fast event is read; so each message meets the state
every message before it left, as in one planned batch. The two paths leave the same store
(tests/unit/test_router_lane.py holds them to it on edge and fleet streams).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvledger.consumer.core.lifecycle import leaves_life, utc
from kvledger.consumer.core.model import (
    PRIMARY_OWNERSHIP,
    Plan,
    SourceState,
)
from kvledger.consumer.core.needs import needs
from kvledger.consumer.core.plan import make_plan
from kvledger.consumer.core.sequence import forward, in_step
from kvledger.consumer.core.validate import check_envelope, check_removed, check_stored
from kvledger.consumer.inbound import Decoded, Inbound, decode
from kvledger.consumer.pipeline import fence_points, warn_model_changes
from kvledger.consumer.store.base import TopicPartition
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import (
    DEFAULT_GROUP_IDX,
    DEFAULT_MEDIUM,
    BlockRemoved,
    BlockStored,
    Envelope,
)
from kvledger.serving.router.store import RouterStore

_FAST_KINDS = (BlockStored, BlockRemoved)  # the events the lane may take


@dataclass(slots=True)
class Tally:
    """What one batch applied: messages read, block events applied (stores + removals),
    and how many messages took the fast lane."""

    messages: int = 0
    block_events: int = 0
    fast: int = 0


class LaneObserver(Protocol):
    """Told, in log order and as each applies, what changed the store's holdings: a store
    or removal the lane applied whole (with the hashes a removal left unheld), or a plan
    (its residency changes) with the messages it was made from (kvledger republish)."""

    def stored(self, env: Envelope, event: BlockStored) -> None: ...
    def removed(self, env: Envelope, event: BlockRemoved, ended: list[bytes]) -> None: ...
    def planned(self, plan: Plan, batch: Sequence[Decoded]) -> None: ...


def run_router_batch(  # noqa: PLR0913 - run_batch's parameters (consumer/pipeline.py) and its observer
    messages: Sequence[Inbound],
    codec: Codec,
    store: RouterStore,
    consumer_group: str,
    read_from: Mapping[TopicPartition, int] | None = None,
    observer: LaneObserver | None = None,
) -> Tally:
    """Apply one batch of consumed messages to the router's store, exactly once (fenced and
    offset as :func:`~kvledger.consumer.pipeline.run_batch` does). The store changes as the
    batch is read, and the offsets move at its end: an error part way leaves the messages
    before it applied and the offsets where they were, and the router then stops following
    the topic, as it does on any error (:meth:`~.index.RouterIndex.position` says why)."""
    batch = [decode(m, codec) for m in messages]
    starts, next_offsets = fence_points(batch, read_from)
    lane = _Lane(store, observer)
    with store.transaction():
        store.fence(consumer_group, starts)
        for d in batch:
            lane.message(d)
        lane.plan_waiting()
        store.write(Plan(), consumer_group, next_offsets)  # the offsets, with the commit
    return lane.tally


class _Lane:
    def __init__(self, store: RouterStore, observer: LaneObserver | None = None) -> None:
        self.store = store
        self.observer = observer
        self.waiting: list[Decoded] = []  # for the planner, in log order
        self.seen_ms: dict[str, int] = {}  # per source, the newest log time applied here
        # per stream, its state and the newest event time applied here
        self.event_ms: dict[tuple[str, str, int], tuple[SourceState, int]] = {}
        self.tally = Tally()

    def message(self, d: Decoded) -> None:
        env = d.envelope
        if env is not None and type(env.event) in _FAST_KINDS:
            if self.waiting:
                self.plan_waiting()
            if self._apply(d, env):
                return
        self.waiting.append(d)

    def plan_waiting(self) -> None:
        """The messages waiting for the planner, planned and applied, after the times the
        fast lane has seen (so the planner reads them): the newest event time of each
        stream and log time of each source (both only ever move forward)."""
        store = self.store
        for state, ms in self.event_ms.values():
            when, last = utc(ms), state.last_event_time
            state.last_event_time = when if last is None else max(last, when)
        self.event_ms.clear()
        for source, ms in self.seen_ms.items():
            life, last = store.lives[source], utc(ms)
            if last > life.last_seen:
                store.lives[source] = replace(life, last_seen=last)
        self.seen_ms.clear()
        if not self.waiting:
            return
        batch, self.waiting = self.waiting, []
        plan = make_plan(batch, store.load(needs(batch, keys=False)))
        store.apply_now(plan)
        if self.observer is not None:
            self.observer.planned(plan, batch)
        warn_model_changes(plan)
        self.tally.messages += plan.messages
        self.tally.block_events += plan.block_events

    def _apply(self, d: Decoded, env: Envelope) -> bool:
        """Apply a store or removal in the fast lane; False (nothing changed) when it is
        not one the lane takes (see the module doc). The store's keys are NamedTuples,
        found here by the plain tuples they equal and hash as (no NamedTuple made)."""
        msg, ev, store = d.message, env.event, self.store
        assert isinstance(ev, BlockStored | BlockRemoved)
        if check_envelope(env, msg.key, msg.timestamp_ms) is not None:
            return False
        source, model, seq = env.source, env.model, env.seq
        group = ev.group_idx if ev.group_idx is not None else DEFAULT_GROUP_IDX
        stream = (source, model, group)
        state = store.sources.get(stream)  # type: ignore[call-overload]
        # The rules' own predicates (consumer/core): only a message that moves its stream on
        # and says nothing new of its source's life is taken here.
        if not in_step(state, env.epoch, seq) or not leaves_life(store.lives.get(source), env):
            return False
        assert state is not None
        g = store.groups.get((model, group))  # type: ignore[call-overload]
        medium = ev.medium if ev.medium is not None else DEFAULT_MEDIUM
        hid = store.holder_ids.get((source, medium, ev.ownership or PRIMARY_OWNERSHIP))
        if g is None or hid is None:
            return False
        spec = store.specs.get((model, group))  # type: ignore[call-overload]
        if isinstance(ev, BlockStored):
            if ev.extra_keys or check_stored(ev, spec) is not None:
                return False
            reused = g.store_run(
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_start,
                ev.token_ids,
                ev.block_size,
                ev.partial,
                ev.lora_name,
                hid,
                state.reports_reuse,
            )
            if reused is None:
                return False
            if self.observer is not None:
                self.observer.stored(env, ev)
        else:
            if check_removed(ev, spec) is not None:
                return False
            g.release_run(ev.block_hashes, hid)
            if self.observer is not None:
                ended = [h for h in ev.block_hashes if not g.refcount(h, hid)]
                self.observer.removed(env, ev, ended)
        forward(state, seq)
        newest = self.event_ms.get(stream)
        if newest is None or newest[1] < env.event_time_ms:
            self.event_ms[stream] = (state, env.event_time_ms)
        ms = msg.timestamp_ms if msg.timestamp_ms is not None else env.event_time_ms
        if self.seen_ms.get(source, -1) < ms:
            self.seen_ms[source] = ms
        tally = self.tally
        tally.messages += 1
        tally.block_events += len(ev.block_hashes)
        tally.fast += 1
        return True
