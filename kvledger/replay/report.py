"""A replay's figures: per policy (tokens from GPU, from CPU, recomputed; the hit rate and
its share of the global pool's; TTFT p50/p99 and the share within the SLO; the busiest
engine over the mean), the pipeline's, the issue's targets checked, and the files:
``<out>/fleet-<date>.json`` (everything, the series included), ``.md`` (the tables) and
``.png`` (hit rate over time per policy, and TTFT's distribution).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any

from kvledger.replay.run import BUCKET_S, ReplayResult, Tally, quantile

logger = logging.getLogger(__name__)
BOUNDS = frozenset({"oracle", "global_pool"})  # not online policies


def policy_figures(tally: Tally, pool_hit: float | None, slo_s: float) -> dict[str, Any]:
    busy = list(tally.busy_s.values())
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    tokens = tally.tokens or 1
    return {
        "requests": tally.requests,
        "gpu_share": tally.gpu_tokens / tokens,
        "cpu_share": tally.cpu_tokens / tokens,
        "recomputed_share": 1 - (tally.gpu_tokens + tally.cpu_tokens) / tokens,
        "cached_tokens": tally.gpu_tokens + tally.cpu_tokens,
        "hit_rate": tally.hit_rate,
        "of_global_pool": tally.hit_rate / pool_hit if pool_hit else None,
        "ttft_p50_s": quantile(sorted(tally.ttfts), 0.5),
        "ttft_p99_s": quantile(sorted(tally.ttfts), 0.99),
        "within_slo": sum(t <= slo_s for t in tally.ttfts) / len(tally.ttfts)
        if tally.ttfts
        else 0.0,
        "busiest_over_mean": max(busy) / mean_busy if mean_busy else 0.0,
        "ttft_lost_mean_s": tally.regret_s / tally.requests if tally.requests else 0.0,
        "cached_missed_share": tally.missed_tokens / tokens,
    }


def targets(figures: dict[str, dict[str, Any]], pipeline: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets this run can check: (what, figure, goal, met)."""
    out: list[dict[str, Any]] = []
    tiered = figures.get("kvledger_tiered")
    if tiered is None:
        return out
    if tiered["of_global_pool"] is not None:
        out.append(
            _target("kvledger_tiered hit rate / global pool's", tiered["of_global_pool"], 0.8)
        )
    others = [f["ttft_p50_s"] for n, f in figures.items() if n not in BOUNDS | {"kvledger_tiered"}]
    if others:
        met = tiered["ttft_p50_s"] <= min(others)
        out.append(
            {
                "what": "kvledger_tiered TTFT p50 at or below every other online policy's",
                "figure": tiered["ttft_p50_s"],
                "goal": min(others),
                "met": met,
            }
        )
    dynamo = figures.get("dynamo")
    if dynamo and dynamo["cached_tokens"]:
        ratio = tiered["cached_tokens"] / dynamo["cached_tokens"]
        out.append(_target("kvledger_tiered cached tokens / dynamo's", ratio, 1.15))
    if pipeline:
        out.append(
            {
                "what": "engine -> router lag p99 (ms)",
                "figure": pipeline["lag_ms_p99"],
                "goal": 100.0,
                "met": pipeline["lag_ms_p99"] <= 100.0,
            }
        )
        out.append(
            {
                "what": "index equals the engines' caches at the end",
                "figure": pipeline["index_differences"],
                "goal": 0,
                "met": pipeline["index_differences"] == 0,
            }
        )
    return out


def _target(what: str, figure: float, goal: float) -> dict[str, Any]:
    return {"what": what, "figure": figure, "goal": goal, "met": figure >= goal}


def summarize(result: ReplayResult) -> dict[str, Any]:
    """Everything the files say, as one JSON-able document."""
    config = result.config
    pool = result.tallies.get("global_pool")
    pool_hit = pool.hit_rate if pool is not None else None
    slo = config.time_model.slo_s
    figures = {n: policy_figures(t, pool_hit, slo) for n, t in result.tallies.items()}
    shape = config.shape()
    return {
        "trace": {
            **asdict(result.summary),
            "path": str(result.summary.path),
            "infinite_cache_share": result.summary.infinite_cache_share,
        },
        "fleet": {
            "engines": shape.engines,
            "gpu_tokens_per_engine": shape.gpu_blocks * shape.block_tokens,
            "cpu_tokens_per_engine": shape.cpu_blocks * shape.block_tokens,
            "block_tokens": shape.block_tokens,
        },
        "time_model": asdict(config.time_model),
        "speed": config.speed,
        "requests": config.limit or result.summary.requests,
        "wall_s": result.wall_s,
        "policies": figures,
        "pipeline": result.pipeline,
        "targets": targets(figures, result.pipeline),
        "series": {
            "bucket_s": BUCKET_S,
            "hit_rate": {
                n: {str(k): v[0] / v[1] for k, v in sorted(t.buckets.items()) if v[1]}
                for n, t in result.tallies.items()
            },
        },
    }


def markdown(doc: dict[str, Any]) -> str:
    fleet, trace = doc["fleet"], doc["trace"]
    lines = [
        f"# Fleet replay: {trace['requests']} requests of {Path(trace['path']).name}"
        f" ({doc['requests']} replayed) at x{doc['speed']:g}",
        "",
        f"{fleet['engines']} engines, each {fleet['cpu_tokens_per_engine']:,} tokens on its"
        " CPU tier"
        f" of which {fleet['gpu_tokens_per_engine']:,} on its GPU; {fleet['block_tokens']}-token"
        f" blocks; wall time {doc['wall_s']:.0f} s. An infinite shared cache would serve"
        f" {trace['infinite_cache_share']:.1%} of the trace's blocks.",
        "",
        "| policy | from GPU | from CPU | recomputed | hit rate | of global pool |"
        " TTFT p50 (s) | TTFT p99 (s) | within SLO | busiest / mean | TTFT lost (s) |"
        " cache missed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, f in doc["policies"].items():
        pool = f"{f['of_global_pool']:.2f}" if f["of_global_pool"] is not None else "-"
        lines.append(
            f"| {name} | {f['gpu_share']:.3f} | {f['cpu_share']:.3f} | {f['recomputed_share']:.3f}"
            f" | {f['hit_rate']:.3f} | {pool} | {f['ttft_p50_s']:.2f} | {f['ttft_p99_s']:.2f}"
            f" | {f['within_slo']:.3f} | {f['busiest_over_mean']:.2f}"
            f" | {f['ttft_lost_mean_s']:.3f} | {f['cached_missed_share']:.3f} |"
        )
    p = doc["pipeline"]
    if p:
        lines += [
            "",
            f"Pipeline: {p['messages']:,} messages ({p['events_per_s']:.0f}/s), engine -> router"
            f" lag p50 {p['lag_ms_p50']:.1f} ms, p99 {p['lag_ms_p99']:.1f} ms; consumer lag p50"
            f" {p['consumer_lag_p50']:.0f}, max {p['consumer_lag_max']} messages; the index and"
            f" the engines' caches differ in {p['index_differences']} of"
            f" {p['index_blocks_compared']:,} blocks at the end.",
        ]
    if doc["targets"]:
        lines += ["", "| target | figure | goal | met |", "| --- | ---: | ---: | --- |"]
        for t in doc["targets"]:
            lines.append(
                f"| {t['what']} | {t['figure']:.3g} | {t['goal']:.3g}"
                f" | {'yes' if t['met'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: ReplayResult, doc: dict[str, Any], target: Path) -> bool:
    """The picture, or False (and a warning) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("no plot: matplotlib is not installed (pip install 'kvledger[bench]')")
        return False
    fig, (over_time, ttft) = plt.subplots(1, 2, figsize=(13, 5))
    for name, series in doc["series"]["hit_rate"].items():
        xs = [(int(k) + 0.5) * BUCKET_S / 60 for k in series]
        over_time.plot(xs, list(series.values()), label=name, linewidth=1)
    over_time.set(
        xlabel="trace minute",
        ylabel="tokens from cache / prompt tokens",
        title="Hit rate over time",
    )
    over_time.legend(fontsize=7)
    for name, tally in result.tallies.items():
        ordered = sorted(tally.ttfts)
        if ordered:
            ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ttft.plot([max(t, 1e-3) for t in ordered], ys, label=name, linewidth=1)
    ttft.set(
        xscale="log",
        xlabel="TTFT (s, time model)",
        ylabel="share of requests",
        title="TTFT distribution",
    )
    ttft.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return True


def write(result: ReplayResult, out_dir: Path, stem: str | None = None) -> list[Path]:
    """The three files, named ``fleet-<date>`` (or ``stem``); the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or f"fleet-{date.today().isoformat()}"
    doc = summarize(result)
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    written[0].write_text(json.dumps(doc, indent=1) + "\n")
    written[1].write_text(markdown(doc))
    if plot(result, doc, out_dir / f"{stem}.png"):
        written.append(out_dir / f"{stem}.png")
    return written
