"""kvledger's router index beside NVIDIA Dynamo's, the same workload into both, in one run.

Dynamo: ``dynamo._core.RadixTree`` from ``ai-dynamo-runtime`` 1.6.1 (PyPI, the ``bench``
extra), through its Python binding; and natively, its ``RadixTree`` from the crate
``dynamo-kv-router`` 1.6.1 (crates.io) in the bench-only crate bench/native. kvledger: the
compiled core's ``Group``, the index a router keeps per (model, group), through its Python
binding and natively (the same crate, bench/native).

The workload is the lookup benchmark's index, built as events instead of SQL rows: 8,000
chains of 128 blocks of 16 tokens (block i of chain c holds token c sixteen times), held by
three holders per chain (64 instances, CPU or STORAGE), each a stored run of 16 to 127
blocks from the chain's start: 24,000 stored events, about 1.74 M stored blocks. Each
(instance, tier) is one Dynamo worker. Dynamo keys its tree by its own hash of each block's
tokens (``compute_block_hash_for_seq``), which the events carry.

Figures: apply rate (Dynamo: one ``apply_event`` per stored event, its JSON encoded
beforehand; kvledger: one ``add_row`` and one ``hold`` per block, the calls the router's
store makes), resident memory per held block (each index built alone in a process of its
own: see :func:`alone`), lookup p50/p99 by hashes and by tokens (each
side's tokens-to-hashes work included), and whether the answers agree: for 200 prompts,
each worker's matched blocks.

The router as a user runs it is measured too ("router, public path"): the same stored
events as Avro envelopes (one source per instance, its group announced first) through
``RouterIndex.apply``, the call its tail makes, and lookups through ``RouterIndex.match`` and
``match_tokens``, the calls its HTTP routes make: memory, apply and lookups of the whole
router (its holders, lives and sequence state as well as the compiled groups) beside
Dynamo's binding, with the same answers checked; its memory, like that of each index, is
read from a process that builds that index alone. Natively, kvledger's apply is also timed
by whole events (``store_run``, the router lane's call, as Dynamo applies whole events),
and each apply figure is the best of three builds made in turn.

Memory as users see it ("as run", bench/peers_process.py): the router through its public
path (with and without ``--dynamo-api``) and Dynamo's binding each in a fresh process,
taking in the stream a poll at a time and then answering, nothing handed back to the
system: the resident set's growth after applying and after answering, its peak, the apply
rate and lookup p50/p99 by tokens, and the answers compared, each side beside Dynamo's.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import PUBLISHED, publish, record
from bench.lookup import CHAINS, INSTANCES, LENGTH
from bench.router import WIDE, _rss, _timed
from kvledger.consumer.inbound import Inbound
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import BlockStored, Envelope, GroupSpec
from kvledger.serving.router.index import RouterIndex

BLOCK = 16
NATIVE = Path(__file__).parent / "native" / "Cargo.toml"


def _holders(c: int) -> list[tuple[int, int]]:
    """(worker, blocks held from the chain's start) for chain c, as bench/lookup.py holds."""
    out = []
    for k in range(3):
        instance = (c * 7 + k * 13) % INSTANCES
        worker = instance * 2 + (1 if k == 2 else 0)  # (instance, CPU) or (instance, STORAGE)
        out.append((worker, 17 + (c * 31 + k * 17) % (LENGTH - 16)))
    return out


def _hashes(c: int) -> list[bytes]:
    return [hashlib.md5(f"{c}/{i}".encode()).digest()[:8] for i in range(LENGTH)]


def _kvledger(chains: list[list[bytes]]) -> tuple[object, float, int]:
    from kvledger._core import Group

    g = Group()
    blocks = 0
    start = time.perf_counter()
    for c, hashes in enumerate(chains):
        tokens = [c] * BLOCK
        for worker, n in _holders(c):
            parent = None
            for i in range(n):
                h = hashes[i]
                g.add_row(h, parent, i * BLOCK, tokens, BLOCK, False, None, True)
                g.hold(h, worker, 1)
                parent = h
            blocks += n
    return g, time.perf_counter() - start, blocks


class _Topic:
    """The workload as the topic would carry it: each holder's stored run as one BlockStored
    envelope of its instance (a source), after that instance's group announcement."""

    def __init__(self, chains: list[list[bytes]]) -> None:
        self.chains = chains
        self.codec = Codec()
        self.seqs: dict[str, int] = {}  # per source: its next sequence number
        self.offset = 0
        self.now = int(time.time() * 1000)

    def messages(self, first: int, last: int) -> list[Inbound]:
        """Chains ``first`` to ``last`` (exclusive), encoded, in publish order."""
        out: list[Inbound] = []
        for c in range(first, last):
            for worker, n in _holders(c):
                instance, storage = divmod(worker, 2)
                source = f"engine-{instance}"
                if source not in self.seqs:
                    out.append(self._message(source, GroupSpec(MODEL, 0, "full_attention",
                                                               BLOCK, BLOCK)))  # fmt: skip
                medium = "STORAGE" if storage else "CPU"
                run = tuple(self.chains[c][:n])
                stored = BlockStored(run, None, (c,) * (BLOCK * n), BLOCK, None, medium, None,
                                     token_start=0)  # fmt: skip
                out.append(self._message(source, stored))
        return out

    def _message(self, source: str, event: GroupSpec | BlockStored) -> Inbound:
        seq = self.seqs.get(source, 0)
        self.seqs[source] = seq + 1
        self.offset += 1
        value = self.codec.encode(Envelope(source, MODEL, 0, 1, seq, self.now, event))
        return Inbound("peers", 0, self.offset - 1, f"{source}/0".encode(), value)


MODEL = "bench"


def _router(chains: list[list[bytes]], dynamo: bool = False) -> tuple[RouterIndex, float, int]:
    """The router fed the workload through its public path; (router, apply seconds, blocks
    applied). Encoding is done in chunks between the timed applies, so the encoded messages
    neither count in the apply time nor sit in memory beside the index."""
    router = RouterIndex("unused:9092", "peers", "bench-peers", dynamo=dynamo,
                         block_retention=None)  # fmt: skip
    topic = _Topic(chains)
    seconds = 0.0
    for first in range(0, len(chains), 200):
        batch = topic.messages(first, min(first + 200, len(chains)))
        start = time.perf_counter()
        router.apply(batch)
        seconds += time.perf_counter() - start
    return router, seconds, router.block_events


def _public_path(
    chains: list[list[bytes]], tree: object, local: dict[int, int], picked: list[int]
) -> dict[str, float]:
    from dynamo._core import compute_block_hash_for_seq

    router, seconds, blocks = _router(chains)
    figures = {
        "router, public path: stored blocks applied": float(blocks),
        "router, public path: apply, block events/s (Avro envelopes, RouterIndex.apply)":
            blocks / seconds,
    }  # fmt: skip
    by_hash = [chains[c] for c in picked]
    tokens = [[c] * (LENGTH * BLOCK) for c in picked]

    def kv_hash(h: list[bytes]) -> object:
        return router.match(MODEL, 0, h, "block", False, WIDE)

    def kv_tokens(t: list[int]) -> object:
        return router.match_tokens(MODEL, 0, t, None, False, WIDE)

    def dyn_tokens(t: list[int]) -> object:
        return tree.find_matches(compute_block_hash_for_seq(t, BLOCK))  # type: ignore[attr-defined]

    gc.freeze()
    for name, kv, kv_in in (("by hashes", kv_hash, by_hash), ("by tokens", kv_tokens, tokens)):
        _timed(kv, kv_in[:200])
        p50, p99, _ = _timed(kv, kv_in)
        figures |= {
            f"router, public path: lookup {name}: p50 us": p50,
            f"router, public path: lookup {name}: p99 us": p99,
        }
    _timed(dyn_tokens, tokens[:200])
    figures["router, public path: Dynamo binding by tokens (same run): p50 us"] = _timed(
        dyn_tokens, tokens
    )[0]
    gc.unfreeze()

    def worker(instance: str, medium: str) -> int:
        return int(instance.removeprefix("engine-")) * 2 + (medium == "STORAGE")

    same = all(
        {worker(h.instance, h.medium): h.matched_blocks for h in kv_tokens(t)}  # type: ignore[attr-defined]
        == {w: n for (w, _), n in dyn_tokens(t).scores.items()}  # type: ignore[attr-defined]
        for t in tokens[:200]
    )
    figures["router, public path: same answers as Dynamo (200 prompts)"] = float(same)
    return figures


def alone(kind: str) -> float:
    """Resident bytes per held block of one index built alone in this process: ``group``
    (the compiled group), ``router`` (the router through its public path) or ``dynamo``
    (Dynamo's binding). In a process of its own, no other index's freed memory is reused
    and counted as nothing; memory freed while building (events made for the build) goes
    back to the system before the reading, so it counts for no one."""
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    chains = [_hashes(c) for c in range(CHAINS)]
    build: dict[str, Callable[[list[list[bytes]]], tuple[object, float, object]]] = {
        "group": _kvledger, "router": _router, "dynamo": _dynamo,
        "router-dynamo-api": lambda chains: _router(chains, dynamo=True),
    }  # fmt: skip
    gc.collect()
    trim(0)
    before = _rss()
    index = build[kind](chains)
    gc.collect()
    trim(0)
    grown = _rss() - before
    del index
    return grown / sum(n for c in range(CHAINS) for _, n in _holders(c))


def _alone_figures() -> dict[str, float]:
    out = {}
    for kind, name in (("group", "kvledger's compiled group"), ("router", "router, public path"),
                       ("router-dynamo-api", "router, public path, with --dynamo-api"),
                       ("dynamo", "Dynamo's binding")):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "bench.peers", "--alone", kind],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        out[f"bytes per held block, built alone: {name}"] = float(done.stdout.split()[-1])
    out["bytes per held block, built alone: router public path / Dynamo's binding"] = (
        out["bytes per held block, built alone: router, public path"]
        / out["bytes per held block, built alone: Dynamo's binding"]
    )
    return out


def _dynamo(chains: list[list[bytes]]) -> tuple[object, float, dict[int, int]]:
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    local = {c: compute_block_hash_for_seq([c] * BLOCK, BLOCK)[0] for c in range(len(chains))}
    events: list[tuple[int, bytes]] = []
    for c, hashes in enumerate(chains):
        ids = [int.from_bytes(h, "big") for h in hashes]
        for worker, n in _holders(c):
            blocks = [{"block_hash": ids[i], "tokens_hash": local[c]} for i in range(n)]
            data = {"stored": {"parent_hash": None, "blocks": blocks}}
            events.append((worker, json.dumps({"event_id": len(events), "data": data}).encode()))
    tree = RadixTree()
    start = time.perf_counter()
    for worker, event in events:
        tree.apply_event(worker, event)
    tree.find_matches([local[0]])  # the events are applied on its thread: wait for them
    return tree, time.perf_counter() - start, local


def main(lookups: int = 2000) -> dict[str, float]:
    try:
        from dynamo._core import compute_block_hash_for_seq
    except ImportError as exc:  # the bench extra is not installed
        raise SystemExit(f"bench.peers needs ai-dynamo-runtime (the bench extra): {exc}") from exc
    chains = [_hashes(c) for c in range(CHAINS)]
    group, kv_s, blocks = _kvledger(chains)
    tree, dyn_s, local = _dynamo(chains)

    rng = random.Random(1)
    picked = [rng.randrange(CHAINS) for _ in range(lookups)]
    by_hash = [chains[c] for c in picked]
    locals_ = [[local[c]] * LENGTH for c in picked]
    tokens = [[c] * (LENGTH * BLOCK) for c in picked]

    kv_hash: Callable[[list[bytes]], object] = group.runs  # type: ignore[attr-defined]
    dyn_hash: Callable[[list[int]], object] = tree.find_matches  # type: ignore[attr-defined]

    def kv_tokens(t: list[int]) -> object:
        return group.match_tokens(t, BLOCK, BLOCK, None)  # type: ignore[attr-defined]

    def dyn_tokens(t: list[int]) -> object:
        return tree.find_matches(compute_block_hash_for_seq(t, BLOCK))  # type: ignore[attr-defined]

    figures: dict[str, float] = {
        "stored blocks": float(blocks),
        "kvledger apply, block events/s (add_row + hold per block)": blocks / kv_s,
        "Dynamo apply, block events/s (apply_event per stored event)": blocks / dyn_s,
    }
    gc.freeze()
    for name, kv, dyn, kv_in, dyn_in in (
        ("by hashes", kv_hash, dyn_hash, by_hash, locals_),
        ("by tokens", kv_tokens, dyn_tokens, tokens, tokens),
    ):
        _timed(kv, kv_in[:200])
        _timed(dyn, dyn_in[:200])
        kv_p50, kv_p99, _ = _timed(kv, kv_in)
        dyn_p50, dyn_p99, _ = _timed(dyn, dyn_in)
        figures |= {
            f"kvledger lookup {name}: p50 us": kv_p50,
            f"kvledger lookup {name}: p99 us": kv_p99,
            f"Dynamo lookup {name}: p50 us": dyn_p50,
            f"Dynamo lookup {name}: p99 us": dyn_p99,
            f"  p50 ratio kvledger / Dynamo {name}": kv_p50 / dyn_p50,
        }
    gc.unfreeze()
    same = all(
        {hid: n for hid, n, _ in group.runs(h)}  # type: ignore[attr-defined]
        == {w: n for (w, _), n in tree.find_matches(lh).scores.items()}  # type: ignore[attr-defined]
        for h, lh in zip(by_hash[:200], locals_, strict=False)
    )
    figures["same answers (200 prompts, each worker's matched blocks)"] = float(same)
    figures |= _public_path(chains, tree, local, picked)
    figures |= _alone_figures()
    _ratios(figures, {
        "router, public path / Dynamo binding: apply rate": (
            "router, public path: apply, block events/s (Avro envelopes, RouterIndex.apply)",
            "Dynamo apply, block events/s (apply_event per stored event)"),
        "router, public path / Dynamo binding: lookup by tokens p50": (
            "router, public path: lookup by tokens: p50 us",
            "router, public path: Dynamo binding by tokens (same run): p50 us"),
    })  # fmt: skip
    from bench.peers_process import measure  # it builds on this module

    figures |= measure(repeat=3)  # each side as its user runs it, in a process of its own
    figures |= native()  # its own process: its memory its own
    record("peers", figures)
    return figures


def _ratios(figures: dict[str, float], ratios: dict[str, tuple[str, str]]) -> None:
    """Each ratio named in ``ratios``: one figure over another, both already in ``figures``."""
    for name, (over, under) in ratios.items():
        figures[name] = figures[over] / figures[under]


def native() -> dict[str, float]:
    """The same workload natively (bench/native: built with the machine's cargo, its crates
    from crates.io, the first time in a few minutes)."""
    done = subprocess.run(
        ["cargo", "run", "--release", "--quiet", "--manifest-path", str(NATIVE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"bench/native failed: {done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout)
    _ratios(figures, {
        "native: apply ratio kvledger / Dynamo": (
            "native: kvledger apply, block events/s", "native: Dynamo apply, block events/s"),
        "native: apply ratio by events (store_run) kvledger / Dynamo": (
            "native: kvledger apply by events (store_run), block events/s",
            "native: Dynamo apply, block events/s"),
        "native: by hashes p50 ratio kvledger / Dynamo": (
            "native: kvledger lookup by hashes: p50 us",
            "native: Dynamo lookup by hashes: p50 us"),
    })  # fmt: skip
    return figures


if __name__ == "__main__":
    if sys.argv[1:2] == ["--alone"]:
        print(alone(sys.argv[2]))
        raise SystemExit(0)
    written = publish({"peers": main()}, PUBLISHED / "peers", command="python -m bench.peers")
    print(f"wrote {', '.join(str(w) for w in written)}")
