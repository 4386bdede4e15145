"""The router policies a replay compares, each over its own fleet, on the same trace.

Every policy sees what a router of its kind can: the request (its full blocks' ids stand in
for its text and its tokens' hashes) and what it has itself sent and not yet seen answered
(:meth:`.fleet.Fleet.outstanding`). The cache state each sees:

- ``round_robin``, ``least_loaded``: none;
- ``cache_aware``: vllm-router's policy: its own tree of what it sent where, no events;
- ``dynamo``: Dynamo's KV router's cost over Dynamo's own radix tree of the GPU tier;
- ``kvledger_gpu`` / ``kvledger_tiered``: kvledger's router index, which learns from the
  engines' events through Kafka only (pipeline.py), GPU holders alone or both tiers with
  their load cost and the router's own decisions as provisional holders;
- ``mooncake_local``: the paper's scheduler on local caches: every instance's cache as
  released, exactly and at once, and its queue exactly;
- ``oracle``: the engines' true state, their queues included: the best TTFT each request
  could get with the same capacities.

The global pool's bound is :class:`PooledLeastLoaded`: one cache of every engine's capacity.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvledger.replay.engines import Served, Tier, cached_split, engine_hash, hash_key
from kvledger.replay.fleet import DynamoSink, Fleet, KnownState
from kvledger.replay.trace import Request
from kvledger.schemas.decisions import HASHES, Decision
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.provisional import Provisional

GROUP = 0


class Policy(Protocol):
    name: str
    fleet: Fleet

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int: ...

    def answered(self, engine: int, served: Served) -> None: ...


def _least(scores: Sequence[float]) -> int:
    """The first engine of the lowest score."""
    return min(range(len(scores)), key=scores.__getitem__)


class _Routed:
    """A policy that keeps nothing of what it routed."""

    fleet: Fleet

    def answered(self, engine: int, served: Served) -> None:
        """The request just routed to ``engine`` was dispatched; ``served`` says when its
        first token comes (when the router hears of it)."""


class RoundRobin(_Routed):
    name = "round_robin"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._next = itertools.cycle(range(fleet.shape.engines))

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int:
        return next(self._next)


class LeastLoaded(_Routed):
    """The fewest prompt tokens sent and not yet answered."""

    name = "least_loaded"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int:
        n = self.fleet.shape.engines
        return _least([self.fleet.outstanding(e, now).tokens for e in range(n)])


class PooledLeastLoaded(LeastLoaded):
    """The global pool's bound: a pooled fleet, routed to the shortest queue."""

    name = "global_pool"

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int:
        return _least([e.queued_s(now) for e in self.fleet.engines])


class CacheAware(_Routed):
    """vllm-router 0.1.17's ``cache_aware`` policy with its launch defaults: the load is each
    worker's requests in flight; when the busiest has more than ``balance_abs`` over the
    idlest and more than ``balance_rel`` times its count, the idlest; else, when the best
    share of the prompt a worker's tree matches is over ``cache_threshold``, the idlest of
    the workers that match that much; else the idlest. The prompt is then added to the
    chosen worker's tree (in every case), which keeps ``tree_blocks`` blocks at most, least
    recently used going first (the router's 2^25 characters per worker at 8 characters a
    token: 4 M tokens). Its tree is keyed by the prompt's token ids; here the blocks' ids
    stand for them, so it matches at block granularity."""

    name = "cache_aware"

    def __init__(
        self,
        fleet: Fleet,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        tree_blocks: int = 8192,
    ) -> None:
        self.fleet = fleet
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.trees = [Tier("tree", tree_blocks) for _ in range(fleet.shape.engines)]

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int:
        n = self.fleet.shape.engines
        loads = [self.fleet.outstanding(e, now).requests for e in range(n)]
        busiest, idlest = max(loads), min(loads)
        candidates: Sequence[int] = range(n)
        if ids and not (
            busiest - idlest > self.balance_abs and busiest > idlest * self.balance_rel
        ):
            matched = [tree.prefix(ids) for tree in self.trees]
            best = max(matched)
            if best / len(ids) > self.cache_threshold:
                candidates = [e for e in range(n) if matched[e] == best]
        chosen = min(candidates, key=loads.__getitem__)
        self.trees[chosen].keep(ids)
        return chosen


@dataclass
class _Active:
    """A request Dynamo's router tracks at a worker until its first token."""

    first_token: float
    prefill_tokens: int  # its prompt's tokens less those cached where it went
    ids: tuple[int, ...]


class DynamoCost(_Routed):
    """Dynamo 1.6.1's KV router with its defaults (the built-in scorer and picker, temperature
    0): the lowest ``max(0, (A + ISL) / B - O) + D + X``, where ``O`` is the blocks of the
    prompt the worker's GPU holds from the start (Dynamo's radix tree, fed the same events),
    ``A`` the prefill tokens of its requests still in prefill (each its prompt less what was
    cached there when routed), ``D`` the distinct full prompt blocks of its active requests
    and ``X`` the prompt's full blocks past the prefix already among them; exact ties are
    broken at random. A request stops being active at its first token: the replay's engines
    only prefill (Mooncake's prefill pool), so the stream ends there."""

    name = "dynamo"

    def __init__(self, fleet: Fleet, tree: DynamoSink, seed: int = 0) -> None:
        self.fleet, self.tree = fleet, tree
        self.active: list[list[_Active]] = [[] for _ in range(fleet.shape.engines)]
        self.random = random.Random(seed)
        self._cached: list[int] = []

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int:
        bt = self.fleet.shape.block_tokens
        overlaps = self.tree.overlaps(ids)
        costs: list[float] = []
        for e, active in enumerate(self.active):
            active[:] = [a for a in active if a.first_token > now]
            prefill = sum(a.prefill_tokens for a in active)
            blocks: set[int] = set()
            present = 0
            for a in active:
                blocks.update(a.ids)
            while present < len(ids) and ids[present] in blocks:
                present += 1
            overlap = overlaps.get(e, 0)
            costs.append(
                max(0.0, (prefill + request.input_length) / bt - overlap)
                + len(blocks)
                + len(ids)
                - present
            )
        low = min(costs)
        ties = [e for e, c in enumerate(costs) if c == low]
        chosen = ties[0] if len(ties) == 1 else self.random.choice(ties)
        cached = min(overlaps.get(chosen, 0) * bt, request.input_length)
        self._pending = (request.input_length - cached, ids)
        return chosen

    def answered(self, engine: int, served: Served) -> None:
        prefill_tokens, ids = self._pending
        if prefill_tokens > 0:  # Dynamo tracks no request with nothing to prefill
            self.active[engine].append(_Active(served.first_token, prefill_tokens, ids))


def _ttft_choice(
    fleet: Fleet,
    request: Request,
    queued: Callable[[int], float],
    hit: Callable[[int], tuple[int, int]],
) -> tuple[int, float]:
    """The engine of the lowest estimated TTFT (its queue, then the prompt's prefill with
    the blocks it holds: GPU, then CPU blocks loaded back), and that engine's prefill."""
    best, best_s, prefill = 0, float("inf"), 0.0
    for e, engine in enumerate(fleet.engines):
        own = cached_split(*hit(e), request.input_length, engine)[2]
        if (s := queued(e) + own) < best_s:
            best, best_s, prefill = e, s, own
    return best, prefill


class Oracle(_Routed):
    """Perfect, instant knowledge: each engine's cache as its queue will leave it and its
    queue exactly; the lowest true TTFT."""

    name = "oracle"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def hit(self, engine: int, ids: tuple[int, ...]) -> tuple[int, int]:
        return self.fleet.engines[engine].hit(ids)

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int:
        engines = self.fleet.engines
        chosen, _ = _ttft_choice(
            self.fleet, request, lambda e: engines[e].queued_s(now), lambda e: self.hit(e, ids)
        )
        return chosen


class MooncakeLocal(Oracle):
    """The paper's scheduler over local caches: the instance of the lowest estimated TTFT
    (its queue, exactly, plus the prefill of what its own cache lacks), every instance's
    cache known as released."""

    name = "mooncake_local"

    def __init__(self, fleet: Fleet, known: KnownState) -> None:
        super().__init__(fleet)
        self.known = known

    def hit(self, engine: int, ids: tuple[int, ...]) -> tuple[int, int]:
        return self.known.hit(engine, ids)


@dataclass(frozen=True, slots=True)
class _Sent:
    """A request the router sent: when, when its first token comes back (the router hears
    of it then, not before), and the prefill it estimated."""

    sent: float
    first_token: float
    estimate_s: float


class KvledgerPolicy(_Routed):
    """kvledger's router index (learning from Kafka only): the engine of the lowest
    estimated TTFT from its holders (GPU holders alone, or both tiers with the load cost of
    CPU blocks) and the router's own model of each engine's queue (:meth:`queued_s`).
    ``tiered`` also holds its own decisions as provisional holders (kvledger's
    :class:`Provisional`, for ``provisional_s`` of trace time) until the engines' events
    show them."""

    def __init__(  # noqa: PLR0913 - the policy's parts, each named by its caller
        self,
        fleet: Fleet,
        index: RouterIndex,
        model: str,
        names: Sequence[str],
        tiered: bool,
        clock: Callable[[], float],
        provisional_s: float = 30.0,
    ) -> None:
        self.fleet, self.index, self.model, self.tiered = fleet, index, model, tiered
        self.name = "kvledger_tiered" if tiered else "kvledger_gpu"
        self.names = list(names)
        self.engine_of = {name: i for i, name in enumerate(names)}
        self.provisional = Provisional(provisional_s, clock=clock) if tiered else None
        self._sent: list[deque[_Sent]] = [deque() for _ in names]
        self._last_answer = [0.0] * len(names)
        self.estimate_s = 0.0  # the prefill estimated for the last request routed

    def holdings(self, ids: tuple[int, ...]) -> list[tuple[int, int]]:
        """(GPU blocks, CPU blocks after them) per engine, as the index answers."""
        keys = [hash_key(h) for h in ids]
        gpu = [0] * len(self.names)
        cpu_run = [0] * len(self.names)
        for holder in self.index.match(self.model, GROUP, keys, include_silent=True):
            e = self.engine_of.get(holder.instance)
            if e is None:
                continue
            if holder.medium == "GPU":
                gpu[e] = max(gpu[e], holder.matched_blocks)
            elif holder.medium == "CPU" and self.tiered:
                cpu_run[e] = max(cpu_run[e], holder.matched_blocks)
        if self.provisional is not None:
            real = {self.names[e]: max(gpu[e], cpu_run[e]) for e in range(len(self.names))}
            for name, depth in self.provisional.depths(
                self.model, GROUP, HASHES, [engine_hash(h) for h in ids], real
            ).items():
                e = self.engine_of[name]
                gpu[e] = max(gpu[e], depth)
        return [(g, max(0, c - g)) for g, c in zip(gpu, cpu_run, strict=True)]

    def queued_s(self, engine: int, now: float) -> float:
        """The router's own model of the engine's queue, first come first served: what it
        sent and has not seen answered, each at its estimated prefill; the one at the head
        began when the answer before it came (or when it was sent, to an idle engine)."""
        queue = self._sent[engine]
        while queue and queue[0].first_token <= now:  # answered: the router has seen it
            self._last_answer[engine] = queue.popleft().first_token
        if not queue:
            return 0.0
        head = queue[0]
        began = max(head.sent, self._last_answer[engine])
        return max(0.0, head.estimate_s - (now - began)) + sum(
            sent.estimate_s for sent in itertools.islice(queue, 1, None)
        )

    def choose(self, request: Request, ids: tuple[int, ...], now: float) -> int:
        held = self.holdings(ids)
        chosen, self.estimate_s = _ttft_choice(
            self.fleet,
            request,
            lambda e: self.queued_s(e, now),
            lambda e: held[e],
        )
        if self.provisional is not None and ids:
            keys = tuple(engine_hash(h) for h in ids)
            self.provisional.add(Decision(self.model, GROUP, self.names[chosen], HASHES, keys))
        return chosen

    def answered(self, engine: int, served: Served) -> None:
        """Until its first token, the request's estimate counts in the engine's queue."""
        self._sent[engine].append(_Sent(served.arrived, served.first_token, self.estimate_s))
