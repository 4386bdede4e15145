"""What each source's subscribers must be told, as a router index applies the log.

:class:`Feed` observes a :class:`~kvledger.serving.router.index.RouterIndex` (its
:class:`~kvledger.serving.router.index.ApplyObserver`): each store or removal the index
applied becomes that event again; each plan's residency changes become stores and removals
(an engine restart ends the tiers that died with it, a recorded loss clears what the index
cleared, a rejected event changes nothing and says nothing). After each chunk, a source's
events of the chunk are one :class:`Output`. So a subscriber that heard every output holds
what the index holds for that source.

Two things the log does not say are said here:

- **Liveness.** A source silent past the window (or gone with a goodbye) is told
  ``AllBlocksCleared``; routing on it stops as lookups stop answering it. When it speaks
  again its holdings are restated (a *snapshot*: ``AllBlocksCleared``, then every block it
  holds, parents first).
- **Joining.** A subscriber that joins or asks for more than is retained is sent a
  snapshot too (:meth:`Feed.snapshot`, asked by the publisher).

Every method runs under the index's lock (the lane calls its observer inside the apply, the
publisher takes the lock), so each output reads the store as the log left it then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kvledger.consumer.core.model import Plan, ResidencyDelta
from kvledger.consumer.inbound import Decoded
from kvledger.schemas.events import BlockRemoved, BlockStored, Envelope
from kvledger.serving.republish.events import (
    CLEARED,
    Blocks,
    chain_maps,
    delta_maps,
    read_blocks,
    removed_map,
    stored_map,
)
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.match import is_live


@dataclass(slots=True)
class Output:
    """One batch (or, for a snapshot, a run of batches) for one source's subscribers."""

    source: str
    model: str
    dp_rank: int | None
    ts: float
    events: list[dict[str, Any]]
    snapshot: bool = False  # begins with AllBlocksCleared and restates every block held
    # A snapshot's events are made from what was read under the index's lock, after it
    # (the part that takes time: the lock is held only for the reading).
    build: Callable[[], list[dict[str, Any]]] | None = None

    def resolved(self) -> list[dict[str, Any]]:
        """The events (a snapshot's made now, once)."""
        if self.build is not None:
            self.events, self.build = self.build(), None
        return self.events


@dataclass(slots=True)
class _Pending:
    events: list[dict[str, Any]] = field(default_factory=list)
    ts: float = 0.0


class Feed:
    """The outputs of the sources ``wanted`` says to republish (see the module doc)."""

    def __init__(
        self, index: RouterIndex, wanted: Callable[[str], bool], silent_after: timedelta
    ) -> None:
        self.index = index
        self.wanted = wanted
        self.window = silent_after
        self.out: list[Output] = []  # ready, in order: the publisher takes them
        self.wake: Callable[[], None] = lambda: None  # told when outputs are ready
        self._pending: dict[str, _Pending] = {}  # the chunk's events per source
        self._ranks: dict[str, int] = {}  # each source's data-parallel rank, as it said
        self._cleared: set[str] = set()  # told AllBlocksCleared: not live since

    # ------------------------------------------------------------------ the lane's calls
    def stored(self, env: Envelope, event: BlockStored) -> None:
        if self.wanted(env.source) and (m := stored_map(event)) is not None:
            self._add(env, [m])

    def removed(self, env: Envelope, event: BlockRemoved, ended: list[bytes]) -> None:
        if self.wanted(env.source) and (m := removed_map(event, ended)) is not None:
            self._add(env, [m])

    def planned(self, plan: Plan, batch: Sequence[Decoded]) -> None:
        for d in batch:
            env = d.envelope
            if env is not None and self.wanted(env.source):
                self._ranks[env.source] = env.dp_rank
        by_source: dict[str, list[ResidencyDelta]] = {}
        for delta in plan.residencies:
            if self.wanted(source := delta.key.instance):
                by_source.setdefault(source, []).append(delta)
        groups = self.index.store.groups
        for source, deltas in by_source.items():
            events = list(delta_maps(deltas, groups))
            if events:
                pending = self._pending.setdefault(source, _Pending())
                pending.events.extend(events)
                pending.ts = max(pending.ts, time.time())

    def applied(self) -> None:
        """A chunk applied: each source's events of it become one output (or, for a source
        told it was cleared and live again, a snapshot)."""
        if not self._pending:
            return
        cut = _now() - self.window
        for source, pending in self._pending.items():
            if source in self._cleared:
                if self._live(source, cut):
                    self.out.append(self.snapshot(source))
                continue  # not live: nothing until it is
            self.out.append(
                Output(
                    source, self._model(source), self._ranks.get(source), pending.ts, pending.events
                )
            )
        self._pending.clear()
        self.wake()

    def _add(self, env: Envelope, events: list[dict[str, Any]]) -> None:
        self._ranks[env.source] = env.dp_rank
        pending = self._pending.setdefault(env.source, _Pending())
        pending.events.extend(events)
        pending.ts = max(pending.ts, env.event_time_ms / 1000)

    # ------------------------------------------------------------------ the publisher's
    def take(self) -> list[Output]:
        """The outputs ready, oldest first."""
        out, self.out = self.out, []
        return out

    def tick(self, sources: Iterable[str]) -> None:
        """Liveness: a source of ``sources`` that stopped being live is told it holds
        nothing; one live again gets its holdings."""
        cut = _now() - self.window
        for source in sources:
            live = self._live(source, cut)
            if not live and source not in self._cleared:
                self._cleared.add(source)
                ts = time.time()
                self.out.append(
                    Output(source, self._model(source), self._ranks.get(source), ts, [CLEARED])
                )
            elif live and source in self._cleared:
                self.out.append(self.snapshot(source))

    def snapshot(self, source: str) -> Output:
        """``AllBlocksCleared``, then, if the source is live, every block it holds (read
        now; the events made when :meth:`Output.resolved` is asked)."""
        read: list[tuple[Blocks, str, int, str]] = []
        if self._live(source, _now() - self.window):
            self._cleared.discard(source)
            store = self.index.store
            mine = [(hid, h) for hid, h in enumerate(store.holders) if h[0] == source]
            for (_, group_idx), g in store.groups.items():
                for hid, (_, medium, ownership) in mine:
                    held = g.held_by(hid)
                    if held:
                        read.append((read_blocks(g, held), medium, group_idx, ownership))
        else:
            self._cleared.add(source)

        def build() -> list[dict[str, Any]]:
            events = [CLEARED]
            for blocks, medium, group_idx, ownership in read:
                events.extend(chain_maps(blocks, medium, group_idx, ownership))
            return events

        return Output(
            source, self._model(source), self._ranks.get(source), time.time(), [], True, build
        )

    def known(self) -> list[str]:
        """The sources the index knows that are republished."""
        return [s for s in self.index.store.lives if self.wanted(s)]

    def _live(self, source: str, cut: datetime) -> bool:
        return is_live(self.index.store.lives.get(source), cut)

    def _model(self, source: str) -> str:
        life = self.index.store.lives.get(source)
        return life.model if life is not None else ""


def _now() -> datetime:
    return datetime.now(UTC)
