"""A fleet of simulated engines (engines.py) under one router policy, and where their changes
go: each engine's changes are released in the order of the instants they happened
(:meth:`Fleet.release`) to the fleet's sinks, that is when its events are published and when
anyone may know them.

Sinks here: :class:`KnownState` (exactly what was released, at once: the paper's
scheduler's view) and :class:`DynamoSink` (Dynamo's own radix tree, fed the engines' GPU
events in its event form); the Kafka path is pipeline.py's.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvledger.replay.engines import (
    CPU,
    GPU,
    Change,
    Engine,
    Served,
    Tier,
    TimeModel,
    cached_split,
    engine_hash,
    held_run,
)


class ChangeSink(Protocol):
    def changed(self, engine: int, changes: Sequence[Change]) -> None: ...


@dataclass(frozen=True)
class FleetShape:
    """How many engines, each tier's capacity in blocks, and the time model."""

    engines: int
    gpu_blocks: int
    cpu_blocks: int
    block_tokens: int = 512
    model: TimeModel = field(default_factory=TimeModel)


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    engine: int
    changes: list[Change]


@dataclass
class InFlight:
    """A request the router sent and has not yet seen the first token of."""

    first_token: float
    tokens: int
    blocks: int


@dataclass(frozen=True, slots=True)
class Load:
    """Requests, prompt tokens and prompt blocks in flight at one engine."""

    requests: int
    tokens: int
    blocks: int


class Fleet:
    """The engines one policy routes to. ``pooled``: one cache of every engine's capacity,
    shared (the global pool's bound)."""

    def __init__(self, shape: FleetShape, pooled: bool = False) -> None:
        self.shape = shape
        n = shape.engines
        if pooled:
            gpu, cpu = Tier(GPU, shape.gpu_blocks * n), Tier(CPU, shape.cpu_blocks * n)
            tiers = [(gpu, cpu)] * n
        else:
            tiers = [(Tier(GPU, shape.gpu_blocks), Tier(CPU, shape.cpu_blocks)) for _ in range(n)]
        self.engines = [
            Engine(i, g, c if shape.cpu_blocks else None, shape.model, shape.block_tokens)
            for i, (g, c) in enumerate(tiers)
        ]
        self.sinks: list[ChangeSink] = []
        self._due: list[_Due] = []
        self._seq = 0
        self.in_flight: list[deque[InFlight]] = [deque() for _ in range(n)]

    def dispatch(self, engine: int, ids: tuple[int, ...], tokens: int, now: float) -> Served:
        served, changes = self.engines[engine].serve(ids, tokens, now)
        if changes and self.sinks:
            self._seq += 1
            heapq.heappush(self._due, _Due(served.first_token, self._seq, engine, changes))
        self.in_flight[engine].append(InFlight(served.first_token, tokens, len(ids)))
        return served

    def release(self, now: float) -> int:
        """Deliver every change that happened by ``now`` to the sinks; how many batches."""
        n = 0
        while self._due and self._due[0].at <= now:
            due = heapq.heappop(self._due)
            for sink in self.sinks:
                sink.changed(due.engine, due.changes)
            n += 1
        return n

    def best(self, ids: tuple[int, ...], tokens: int, now: float) -> tuple[float, int]:
        """The lowest TTFT and the most cached tokens any engine offers the request now (the
        engines' true state): what no router could beat."""
        ttft, cached = float("inf"), 0
        for engine in self.engines:
            ttft = min(ttft, engine.ttft(ids, tokens, now))
            g, c, _ = cached_split(*engine.hit(ids), tokens, engine)
            cached = max(cached, g + c)
        return ttft, cached

    def outstanding(self, engine: int, now: float) -> Load:
        """What the router has sent ``engine`` and not seen answered by ``now``."""
        queue = self.in_flight[engine]
        while queue and queue[0].first_token <= now:
            queue.popleft()
        return Load(len(queue), sum(f.tokens for f in queue), sum(f.blocks for f in queue))


class KnownState:
    """Each engine's tiers as its released changes say: exact, and known at once."""

    def __init__(self, engines: int) -> None:
        self.held: list[dict[str, set[int]]] = [{GPU: set(), CPU: set()} for _ in range(engines)]

    def changed(self, engine: int, changes: Sequence[Change]) -> None:
        tiers = self.held[engine]
        for change in changes:
            if change.stored:
                tiers[change.medium].update(change.ids)
            else:
                tiers[change.medium].difference_update(change.ids)

    def hit(self, engine: int, ids: tuple[int, ...]) -> tuple[int, int]:
        """(leading blocks on the GPU, blocks after them on the CPU), as known."""
        tiers = self.held[engine]
        g = held_run(ids, tiers[GPU])
        return g, held_run(ids, tiers[CPU], g) - g


class DynamoSink:
    """Dynamo's own radix tree (``dynamo._core.RadixTree``, ai-dynamo-runtime), fed each
    engine's GPU stores and removals in Dynamo's event form (Dynamo 1.6.1's router indexes
    the GPU tier only). Block ids serve as both the engine's hash and the tokens' hash."""

    def __init__(self) -> None:
        from dynamo._core import RadixTree  # the bench extra (ai-dynamo-runtime)

        self.tree: Any = RadixTree()
        self._event_id = 0

    def changed(self, engine: int, changes: Sequence[Change]) -> None:
        for change in changes:
            if change.medium != GPU:
                continue
            self._event_id += 1
            if change.stored:
                blocks = [
                    {"block_hash": engine_hash(h), "tokens_hash": engine_hash(h)}
                    for h in change.ids
                ]
                parent = engine_hash(change.parent) if change.parent is not None else None
                data: dict[str, Any] = {"stored": {"parent_hash": parent, "blocks": blocks}}
            else:
                data = {"removed": {"block_hashes": [engine_hash(h) for h in change.ids]}}
            event = {"event_id": self._event_id, "data": data}
            self.tree.apply_event(engine, json.dumps(event).encode())

    def overlaps(self, ids: tuple[int, ...]) -> dict[int, int]:
        """Leading blocks each engine holds on its GPU, as Dynamo's tree answers."""
        scores = self.tree.find_matches([engine_hash(h) for h in ids]).scores
        return {worker: n for (worker, _rank), n in scores.items()}
