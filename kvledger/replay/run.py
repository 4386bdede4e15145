"""`kvledger replay`: a request trace through fleets of simulated engines, one fleet per router
policy, all on the same requests at the same instants; the wiring is :func:`replay`.

Time: the trace's own (seconds from its start) drives the engines' time model; ``speed``
only compresses the wall clock the replay runs on (x10: an hour of trace in six minutes),
which is what the live pipeline (pipeline.py) works at: its events per second grow with it,
and the lag it adds to the kvledger policies' view is wall time, so ``speed`` times as much
trace time.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.replay import PIPELINE_POLICIES, POLICIES
from kvledger.replay.engines import CPU, GPU, Served, TimeModel, hash_key
from kvledger.replay.fleet import DynamoSink, Fleet, FleetShape, KnownState
from kvledger.replay.pipeline import Pipeline
from kvledger.replay.policies import (
    CacheAware,
    DynamoCost,
    KvledgerPolicy,
    LeastLoaded,
    MooncakeLocal,
    Oracle,
    Policy,
    PooledLeastLoaded,
    RoundRobin,
)
from kvledger.replay.trace import Request, TraceSummary, check_trace, read_trace

logger = logging.getLogger(__name__)

BUCKET_S = 60.0  # the hit rate over time, per minute of trace


@dataclass(frozen=True)
class ReplayConfig:
    """What to replay and on what fleet. Each engine caches ``tokens_per_engine`` on its CPU
    tier, of which the GPU keeps the most recent ``gpu_share``."""

    trace: Path
    engines: int = 10
    tokens_per_engine: int = 3_000_000
    gpu_share: float = 1 / 6
    speed: float = 10.0
    block_tokens: int = 512
    policies: tuple[str, ...] = POLICIES
    limit: int | None = None  # the trace's first requests only
    bootstrap: str | None = None  # Kafka: the kvledger policies' pipeline
    kafka: dict[str, object] = field(default_factory=dict)
    time_model: TimeModel = field(default_factory=TimeModel)

    def shape(self) -> FleetShape:
        cpu = self.tokens_per_engine // self.block_tokens
        gpu = int(cpu * self.gpu_share)
        return FleetShape(self.engines, gpu, cpu, self.block_tokens, self.time_model)


@dataclass
class Tally:
    """One policy's figures over the replay."""

    requests: int = 0
    tokens: int = 0
    gpu_tokens: int = 0
    cpu_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    busy_s: dict[int, float] = field(default_factory=dict)
    buckets: dict[int, list[int]] = field(default_factory=dict)  # minute -> [hit, tokens]
    # Against the best engine for each request (its fleet's true state when it came): the
    # TTFT lost and the cached tokens missed, summed; the least TTFT lost (never below 0).
    regret_s: float = 0.0
    missed_tokens: int = 0
    worst_regret_s: float = float("inf")

    def add(self, served: Served, best_ttft: float, best_cached: int) -> None:
        """One request served; ``best_*``: what the best engine for it offered (its fleet's
        true state when it came)."""
        self.regret_s += served.ttft - best_ttft
        self.missed_tokens += best_cached - served.gpu_tokens - served.cpu_tokens
        self.worst_regret_s = min(self.worst_regret_s, served.ttft - best_ttft)
        self.requests += 1
        self.tokens += served.tokens
        self.gpu_tokens += served.gpu_tokens
        self.cpu_tokens += served.cpu_tokens
        self.ttfts.append(served.ttft)
        e = served.engine
        self.busy_s[e] = self.busy_s.get(e, 0.0) + served.first_token - served.started
        bucket = self.buckets.setdefault(int(served.arrived // BUCKET_S), [0, 0])
        bucket[0] += served.gpu_tokens + served.cpu_tokens
        bucket[1] += served.tokens

    @property
    def hit_rate(self) -> float:
        return (self.gpu_tokens + self.cpu_tokens) / self.tokens if self.tokens else 0.0


@dataclass
class ReplayResult:
    config: ReplayConfig
    summary: TraceSummary
    tallies: dict[str, Tally]
    wall_s: float
    pipeline: dict[str, object] = field(default_factory=dict)


def _build(
    config: ReplayConfig, pipeline: Pipeline | None, clock: Callable[[], float]
) -> list[Policy]:
    shape = config.shape()
    policies: list[Policy] = []
    for name in config.policies:
        fleet = Fleet(shape, pooled=name == "global_pool")
        policy: Policy
        if name == "round_robin":
            policy = RoundRobin(fleet)
        elif name == "least_loaded":
            policy = LeastLoaded(fleet)
        elif name == "cache_aware":
            policy = CacheAware(fleet)
        elif name == "dynamo":
            tree = DynamoSink()
            fleet.sinks.append(tree)
            policy = DynamoCost(fleet, tree)
        elif name in PIPELINE_POLICIES:
            if pipeline is None or pipeline.index is None:
                raise ValueError(f"{name} needs Kafka: give a bootstrap server")
            model = f"replay-{name}"
            names = [f"{name}-e{i:03d}" for i in range(shape.engines)]
            fleet.sinks.append(pipeline.fleet_sink(model, names, shape.block_tokens))
            tiered = name == "kvledger_tiered"
            policy = KvledgerPolicy(fleet, pipeline.index, model, names, tiered, clock)
        elif name == "mooncake_local":
            known = KnownState(shape.engines)
            fleet.sinks.append(known)
            policy = MooncakeLocal(fleet, known)
        elif name == "oracle":
            policy = Oracle(fleet)
        elif name == "global_pool":
            policy = PooledLeastLoaded(fleet)
        else:
            raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        policies.append(policy)
    return policies


class _Clock:
    """The replay's instant, in seconds of trace time (what provisional holders age by)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _play(request: Request, policies: Sequence[Policy], tallies: dict[str, Tally], bt: int) -> None:
    """One request, routed by every policy on its own fleet."""
    now = request.at_ms / 1000
    ids = request.full_blocks(bt)
    for policy in policies:
        best = policy.fleet.best(ids, request.input_length, now)
        engine = policy.choose(request, ids, now)
        served = policy.fleet.dispatch(engine, ids, request.input_length, now)
        policy.answered(engine, served)
        tallies[policy.name].add(served, *best)


def replay(
    config: ReplayConfig, progress: Callable[[int, int], None] | None = None
) -> ReplayResult:
    """Check the trace whole, start the pipeline (when a kvledger policy runs), then play
    each request at its instant: release what the engines did by then, and let every policy
    route it on its own fleet. At the end, the index is drained and compared with the
    engines' caches."""
    summary = check_trace(config.trace, config.block_tokens)
    total = min(summary.requests, config.limit or summary.requests)
    pipeline = None
    if PIPELINE_POLICIES & set(config.policies):
        if config.bootstrap is None:
            raise ValueError("the kvledger policies need Kafka: give a bootstrap server")
        topic = f"kvledger-replay-{uuid.uuid4().hex[:8]}"
        pipeline = Pipeline(config.bootstrap, topic, dict(config.kafka))
    clock = _Clock()
    began = time.monotonic()
    try:
        if pipeline is not None:
            pipeline.start()
        policies = _build(config, pipeline, clock)
        tallies = {p.name: Tally() for p in policies}
        fleets = [p.fleet for p in policies]
        next_sample = 0.0
        requests = itertools.islice(read_trace(config.trace, config.block_tokens), total)
        for done, request in enumerate(requests, 1):
            clock.now = request.at_ms / 1000
            if (wait := began + clock.now / config.speed - time.monotonic()) > 0:
                time.sleep(wait)
            for fleet in fleets:
                fleet.release(clock.now)
            if pipeline is not None and time.monotonic() >= next_sample:
                pipeline.sample()
                next_sample = time.monotonic() + 1.0
            _play(request, policies, tallies, config.block_tokens)
            if progress is not None:
                progress(done, total)
        for fleet in fleets:
            fleet.release(float("inf"))
        figures: dict[str, object] = {}
        if pipeline is not None:
            figures = _pipeline_figures(pipeline, policies, time.monotonic() - began)
        return ReplayResult(config, summary, tallies, time.monotonic() - began, figures)
    finally:
        if pipeline is not None:
            pipeline.stop()


def _pipeline_figures(
    pipeline: Pipeline, policies: Sequence[Policy], wall_s: float
) -> dict[str, object]:
    """Drain the pipeline, then its figures and whether the index equals the engines."""
    pipeline.drain()
    assert pipeline.index is not None
    differences = 0
    compared = 0
    for policy in policies:
        if not isinstance(policy, KvledgerPolicy):
            continue
        held = pipeline.held(policy.model, policy.names)
        for e, engine in enumerate(policy.fleet.engines):
            for medium, tier in ((GPU, engine.gpu), (CPU, engine.cpu)):
                truth = {hash_key(b) for b in tier.blocks} if tier is not None else set()
                said = held[(policy.names[e], medium)]
                differences += len(truth ^ said)
                compared += len(truth)
    lags = sorted(pipeline.index.lags_ms)
    messages = len(lags)
    return {
        "messages": messages,
        "events_per_s": messages / wall_s if wall_s else 0.0,
        "lag_ms_p50": quantile(lags, 0.5),
        "lag_ms_p99": quantile(lags, 0.99),
        "consumer_lag_max": max(pipeline.behind, default=0),
        "consumer_lag_p50": quantile(sorted(pipeline.behind), 0.5),
        "index_blocks_compared": compared,
        "index_differences": differences,
    }


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (0 for none)."""
    if not values:
        return 0.0
    return float(values[min(len(values) - 1, int(q * len(values)))])
