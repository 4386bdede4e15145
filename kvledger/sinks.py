"""Where a simulated engine's events go: the sink protocol, and a sink that keeps them in
memory (tests and benchmarks; `kvledger simulate` uses a KVEventPublisher)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvledger.producer.tracker import (
    GroupOffloadConfig,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    group_announcement,
)
from kvledger.schemas.events import BlockRemoved, BlockStored, GroupSpec, KVEvent


class EventSink(Protocol):
    """Where an engine's events go: a publisher, or a local collector."""

    @property
    def tracker(self) -> OffloadingEventsTracker: ...
    def announce_groups(self, group_configs: Iterable[GroupOffloadConfig]) -> None: ...
    def announce_group_spec(self, spec: GroupSpec) -> None: ...
    def publish(self, offloading_events: Iterable[OffloadingEvent]) -> int: ...
    def publish_events(self, events: Iterable[KVEvent]) -> int: ...


class CollectingSink:
    """An EventSink that keeps translated events in memory (tests, benchmarks)."""

    def __init__(self, model: str) -> None:
        self._tracker = OffloadingEventsTracker()
        self.model = model
        self.events: list[KVEvent] = []

    @property
    def tracker(self) -> OffloadingEventsTracker:
        return self._tracker

    def announce_groups(self, group_configs: Iterable[GroupOffloadConfig]) -> None:
        for cfg in group_configs:
            self.announce_group_spec(group_announcement(self.model, cfg))

    def announce_group_spec(self, spec: GroupSpec) -> None:
        self._tracker.set_group_spec(
            spec.group_idx, OffloadingEventGroupSpec(spec.kind, spec.sliding_window)
        )
        self.events.append(spec)

    def publish(self, offloading_events: Iterable[OffloadingEvent]) -> int:
        out: list[BlockStored | BlockRemoved] = self._tracker.take_events(offloading_events)
        self.events.extend(out)
        return len(out)

    def publish_events(self, events: Iterable[KVEvent]) -> int:
        before = len(self.events)
        self.events.extend(events)
        return len(self.events) - before
