"""The router and Dynamo's binding as users run them, each in a process of its own.

bench.peers' memory figures ("built alone") read each index's growth once the memory freed
while building it has been handed back to the system (``malloc_trim``). A user's process
hands nothing back: what it shows is the resident size of a process that took in the
stream and has been answering. This measures that, one side per child process (so the
resident set is that side's alone), each doing what its user does:

- ``router`` (and ``router-dynamo-api``, the router with ``--dynamo-api``'s block hashes):
  a :class:`~kvledger.serving.router.index.RouterIndex` with ``kvledger serve --memory``'s
  defaults fed the stream's Avro-encoded messages through :meth:`RouterIndex.apply`, the call
  its tail makes, about a poll's worth (its ``batch_size``, 5,000 messages) at a time; then
  lookups by tokens through :meth:`RouterIndex.match_tokens`, the call its HTTP route makes.
- ``dynamo``: Dynamo's ``RadixTree`` (``ai-dynamo-runtime``) fed the same stored events in
  its own form (JSON, one ``apply_event`` each), the same chains at a time; then the same
  lookups, its tokens hashed by ``compute_block_hash_for_seq`` first.

The workload is bench.peers' (its chains, holders and lookups), made a chunk at a time so
that only the index stays resident. Each side reports its resident set (``VmRSS``) before
the index exists, after applying, after answering, and after a ``gc.collect`` and
``malloc_trim`` (what "built alone" reads); its peak (``VmHWM``); its apply rate (block
events per second, only the apply calls timed, Dynamo's waited for on its own thread);
lookup p50/p99 (each prompt's token list made before its timing); and its answers to the
first 200 prompts, each worker's matched blocks, which the parent compares.

The sides run in turn, ``--repeat`` times (3 unless told): each timing is the best of its
side's runs, each memory figure their median. ``python -m bench.peers_process [--chains N]
[--lookups N] [--repeat N] [--publish]`` runs it alone and prints the sides beside each
other (``--publish``: into bench/results/peers-process/); bench.peers adds its figures to its own.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import PUBLISHED, percentiles_ms, publish
from bench.lookup import CHAINS, LENGTH
from bench.peers import BLOCK, MODEL, _hashes, _holders, _Topic
from bench.router import WIDE

SIDES = {
    "router": "router, public path",
    "router-dynamo-api": "router, public path, with --dynamo-api",
    "dynamo": "Dynamo's binding",
}
ANSWERED = 200  # prompts whose answers are compared
PER_POLL = 5000 // 3  # chains a poll of the router's tail carries (batch_size 5000, 3 a chain)
RATIOS = {  # figure: its ratio's name
    "RSS growth after applying, MiB": "RSS growth after applying",
    "RSS growth after answering, MiB": "RSS growth after answering",
    "apply, block events/s": "apply rate",
    "lookup by tokens: p50 us": "lookup by tokens p50",
}
GROWTH = ("rss_applied", "rss_answered", "rss_trimmed", "rss_peak")  # read over rss_before
ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _prompts(chains: int, lookups: int) -> list[int]:
    """The chain each lookup asks for, as bench.peers picks them."""
    rng = random.Random(1)
    return [rng.randrange(chains) for _ in range(lookups)]


class _RouterSide:
    """The router fed Avro envelopes through its public apply, asked by tokens."""

    def __init__(self, chains: int, dynamo: bool) -> None:
        from kvledger.serving.router.index import RouterIndex

        self.chains: list[list[bytes]] = [[] for _ in range(chains)]  # a chunk's at a time
        self.topic = _Topic(self.chains)
        self.router = RouterIndex("unused:9092", "peers", "bench-peers", dynamo=dynamo)
        self.per_chunk = PER_POLL

    def apply(self, first: int, last: int) -> float:
        for c in range(first, last):
            self.chains[c] = _hashes(c)
        batch = self.topic.messages(first, last)
        for c in range(first, last):
            self.chains[c] = []
        start = time.perf_counter()
        self.router.apply(batch)
        return time.perf_counter() - start

    def blocks(self) -> int:
        return self.router.block_events

    def ask(self, tokens: list[int]) -> object:
        return self.router.match_tokens(MODEL, 0, tokens, None, False, WIDE)

    @staticmethod
    def answer(found: Any) -> dict[int, int]:
        return {
            int(h.instance.removeprefix("engine-")) * 2 + (h.medium == "STORAGE"): h.matched_blocks
            for h in found
        }


class _DynamoSide:
    """Dynamo's RadixTree fed its JSON events, asked by tokens hashed its way."""

    def __init__(self, chains: int) -> None:
        from dynamo._core import RadixTree, compute_block_hash_for_seq

        self.hash_seq = compute_block_hash_for_seq
        self.tree = RadixTree()
        self.per_chunk = PER_POLL  # the same chains at a time as the router
        self.events = 0
        self.applied = 0

    def apply(self, first: int, last: int) -> float:
        events: list[tuple[int, bytes]] = []
        for c in range(first, last):
            local = self.hash_seq([c] * BLOCK, BLOCK)[0]
            ids = [int.from_bytes(h, "big") for h in _hashes(c)]
            for worker, n in _holders(c):
                blocks = [{"block_hash": ids[i], "tokens_hash": local} for i in range(n)]
                data = {"stored": {"parent_hash": None, "blocks": blocks}}
                body = json.dumps({"event_id": self.events, "data": data}).encode()
                events.append((worker, body))
                self.events += 1
                self.applied += n
        start = time.perf_counter()
        for worker, event in events:
            self.tree.apply_event(worker, event)
        self.tree.find_matches([0])  # applied on the tree's own thread: wait for them
        return time.perf_counter() - start

    def blocks(self) -> int:
        return self.applied

    def ask(self, tokens: list[int]) -> object:
        return self.tree.find_matches(self.hash_seq(tokens, BLOCK))

    @staticmethod
    def answer(found: Any) -> dict[int, int]:
        return {int(w): int(n) for (w, _), n in found.scores.items()}


def run_side(kind: str, chains: int, lookups: int) -> dict[str, Any]:
    """One side (a key of :data:`SIDES`) in this process, as its user runs it: resident
    bytes before, after applying, after answering and after trimming, the peak, apply
    seconds and blocks, lookup p50/p99 (µs), and the answers to the first prompts (each
    a list of [worker, matched blocks], sorted). Meant for a fresh process: see
    :func:`measure`."""
    if kind not in SIDES:
        raise ValueError(f"unknown side {kind!r}: one of {', '.join(SIDES)}")
    picked = _prompts(chains, lookups)
    gc.collect()
    before = _status("VmRSS")
    side = _DynamoSide(chains) if kind == "dynamo" else _RouterSide(chains, kind != "router")
    seconds = 0.0
    for first in range(0, chains, side.per_chunk):
        seconds += side.apply(first, min(first + side.per_chunk, chains))
    applied = _status("VmRSS")
    times: list[float] = []
    answers: list[list[list[int]]] = []
    for i, c in enumerate(picked):
        tokens = [c] * (LENGTH * BLOCK)
        start = time.perf_counter()
        found = side.ask(tokens)
        times.append(time.perf_counter() - start)
        if i < ANSWERED:
            answers.append(sorted([w, n] for w, n in side.answer(found).items()))
    answered = _status("VmRSS")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = _status("VmRSS")
    timed = times[min(ANSWERED, len(times) // 2) :]  # the first ones warm it up
    p50, p99 = percentiles_ms(timed) if timed else (0.0, 0.0)
    # The kernel's counters lag by a few pages a thread: the peak is at least what was read.
    peak = max(_status("VmHWM"), applied, answered)
    rss = {"rss_before": before, "rss_applied": applied, "rss_answered": answered}
    rss |= {"rss_trimmed": trimmed, "rss_peak": peak}
    return rss | {
        "blocks": side.blocks(),
        "apply_s": seconds,
        "p50_us": p50 * 1000,
        "p99_us": p99 * 1000,
        "answers": answers,
    }


def _child(kind: str, chains: int, lookups: int) -> dict[str, Any]:
    side = ["--side", kind, "--chains", str(chains), "--lookups", str(lookups)]
    command = [sys.executable, "-m", "bench.peers_process", *side]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"bench.peers_process --side {kind} failed: {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out


BEST = ("apply_s", "p50_us", "p99_us")  # timings: the least of the runs, as bench.peers'


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's runs as one: each timing the best (least) of them, as bench.peers takes the
    best of its builds (the machine's other loads only slow a run down); each memory
    figure their median; their answers, if every run's agree (else None)."""
    out: dict[str, Any] = {
        key: (min if key in BEST else statistics.median)(r[key] for r in runs)
        for key in runs[0]
        if key != "answers"
    }
    same = all(r["answers"] == runs[0]["answers"] for r in runs)
    out["answers"] = runs[0]["answers"] if same else None
    return out


def measure(
    chains: int = CHAINS,
    lookups: int = 2000,
    kinds: tuple[str, ...] = tuple(SIDES),
    repeat: int = 1,
) -> dict[str, float]:
    """Each side of ``kinds`` (``dynamo`` the baseline) in a fresh process, the sides in
    turn, ``repeat`` times: figures named ``as run, <side>: ...`` (MiB of growth over the
    resident set before the index, block events/s, µs; see :func:`_combine`), each
    router side's ratio to Dynamo's binding, and whether the answers are the same."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for _ in range(repeat):
        for kind in kinds:
            runs[kind].append(_child(kind, chains, lookups))
    sides = {kind: _combine(r) for kind, r in runs.items()}
    figures: dict[str, float] = {}
    for kind, s in sides.items():
        name = f"as run, {SIDES[kind]}"
        mib = {key: (s[key] - s["rss_before"]) / MIB for key in GROWTH}
        figures |= {
            f"{name}: stored blocks applied": float(s["blocks"]),
            f"{name}: RSS before the index, MiB": s["rss_before"] / MIB,
            f"{name}: RSS growth after applying, MiB": mib["rss_applied"],
            f"{name}: RSS growth after answering, MiB": mib["rss_answered"],
            f"{name}: RSS growth after gc + malloc_trim, MiB": mib["rss_trimmed"],
            f"{name}: peak RSS growth (VmHWM), MiB": mib["rss_peak"],
            f"{name}: apply, block events/s": s["blocks"] / s["apply_s"],
            f"{name}: lookup by tokens: p50 us": s["p50_us"],
            f"{name}: lookup by tokens: p99 us": s["p99_us"],
        }
    if "dynamo" in sides:
        base = f"as run, {SIDES['dynamo']}"
        for kind in (k for k in sides if k != "dynamo"):
            name = f"as run, {SIDES[kind]}"
            for figure, short in RATIOS.items():
                ratio = figures[f"{name}: {figure}"] / figures[f"{base}: {figure}"]
                figures[f"{name} / Dynamo's binding: {short}"] = ratio
            figures[f"{name}: same answers as Dynamo's binding ({ANSWERED} prompts)"] = float(
                sides[kind]["answers"] is not None
                and sides[kind]["answers"] == sides["dynamo"]["answers"]
                and sides[kind]["blocks"] == sides["dynamo"]["blocks"]
            )
    return figures


def table(figures: dict[str, float], kinds: tuple[str, ...] = tuple(SIDES)) -> str:
    """The sides beside each other: one row per figure, one column per side, then each
    router side's ratio to Dynamo's binding."""
    rows = (
        "stored blocks applied",
        "RSS before the index, MiB",
        "RSS growth after applying, MiB",
        "RSS growth after answering, MiB",
        "RSS growth after gc + malloc_trim, MiB",
        "peak RSS growth (VmHWM), MiB",
        "apply, block events/s",
        "lookup by tokens: p50 us",
        "lookup by tokens: p99 us",
    )
    present = [k for k in kinds if f"as run, {SIDES[k]}: {rows[0]}" in figures]
    head = [f"{'':<40}"] + [f"{k:>18}" for k in present]
    head += [f"{k + ' / dynamo':>28}" for k in present if k != "dynamo" and "dynamo" in present]
    lines = ["".join(head)]
    for row in rows:
        values = [figures[f"as run, {SIDES[k]}: {row}"] for k in present]
        cells = [f"{row:<40}"] + [f"{v:>18,.2f}" for v in values]
        if "dynamo" in present:
            base = values[present.index("dynamo")]
            cells += [
                f"{v / base:>28,.2f}" for k, v in zip(present, values, strict=True) if k != "dynamo"
            ]
        lines.append("".join(cells))
    for k in present:
        same = f"as run, {SIDES[k]}: same answers as Dynamo's binding ({ANSWERED} prompts)"
        if same in figures:
            lines.append(f"{k}: same answers as Dynamo's binding: {bool(figures[same])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers_process", description=__doc__)
    parser.add_argument("--side", choices=SIDES, help="run one side here, print it as JSON")
    parser.add_argument("--chains", type=int, default=CHAINS, help="chains of 128 blocks")
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side, in turn")
    parser.add_argument(
        "--publish",
        action="store_true",
        help="write bench/results/peers-process/<date>.json and .md",
    )
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args.side, args.chains, args.lookups)))
        return
    figures = measure(args.chains, args.lookups, repeat=args.repeat)
    print(table(figures))
    if args.publish:
        command = (
            f"python -m bench.peers_process --chains {args.chains} --lookups "
            f"{args.lookups} --repeat {args.repeat}"
        )
        written = publish({"peers_process": figures}, PUBLISHED / "peers-process", command=command)
        print(f"wrote {', '.join(str(w) for w in written)}")


if __name__ == "__main__":
    main()
