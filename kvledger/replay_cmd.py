"""`kvledger replay`: a trace through fleets of simulated engines (kvledger.replay)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvledger import settings
from kvledger.progress import Progress
from kvledger.replay import PIPELINE_POLICIES
from kvledger.replay.engines import TimeModel
from kvledger.replay.report import markdown, summarize, write
from kvledger.replay.run import ReplayConfig, replay
from kvledger.replay.trace import check_trace


def run(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    if not trace.is_file():
        print(f"kvledger replay: no trace file at {trace}", file=sys.stderr)
        return 2
    needs_kafka = bool(PIPELINE_POLICIES & set(args.policies))
    config = ReplayConfig(
        trace=trace,
        engines=args.engines,
        tokens_per_engine=args.tokens_per_engine,
        gpu_share=args.gpu_share,
        speed=args.speed,
        block_tokens=args.block_tokens,
        policies=tuple(args.policies),
        limit=args.requests,
        bootstrap=settings.kafka_bootstrap(args) if needs_kafka else None,
        kafka=dict(settings.kafka_settings(args)),
        time_model=dataclasses.replace(TimeModel(), slo_s=args.slo),
    )
    summary = check_trace(trace, args.block_tokens)  # a bad line refused before anything runs
    total = min(summary.requests, args.requests or summary.requests)
    shape = config.shape()
    print(
        f"trace:     {summary.requests:,} requests over {summary.span_ms / 60000:.1f} min;"
        f" replaying {total:,} at x{args.speed:g}"
        f" (about {summary.span_ms * total / summary.requests / 1000 / args.speed:.0f} s)"
    )
    print(
        f"fleets:    {len(config.policies)} of {shape.engines} engines, each"
        f" {shape.cpu_blocks * shape.block_tokens:,} tokens on CPU,"
        f" {shape.gpu_blocks * shape.block_tokens:,} on GPU"
    )
    result = replay(config, Progress("replaying"))
    print(markdown(summarize(result)))
    for path in write(result, Path(args.out), args.name):
        print(f"wrote      {path}")
    return 0
