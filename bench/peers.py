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
store makes), resident memory per held block, lookup p50/p99 by hashes and by tokens (each
side's tokens-to-hashes work included), and whether the answers agree: for 200 prompts,
each worker's matched blocks. Natively, kvledger's apply is also timed by whole events
(``store_run``, the router lane's call, as Dynamo applies whole events), and each apply
figure is the best of three builds made in turn.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import record
from bench.lookup import CHAINS, INSTANCES, LENGTH
from bench.router import _rss, _timed

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
    gc.collect()
    before = _rss()
    group, kv_s, blocks = _kvledger(chains)
    gc.collect()
    kv_bytes = _rss() - before
    before = _rss()
    tree, dyn_s, local = _dynamo(chains)
    gc.collect()
    dyn_bytes = _rss() - before

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
        "kvledger bytes per held block": kv_bytes / blocks,
        "Dynamo bytes per held block": dyn_bytes / blocks,
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
    figures |= native()  # its own process: its memory its own
    record("peers", figures)
    return figures


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
    figures["native: apply ratio kvledger / Dynamo"] = (
        figures["native: kvledger apply, block events/s"]
        / figures["native: Dynamo apply, block events/s"]
    )
    figures["native: apply ratio by events (store_run) kvledger / Dynamo"] = (
        figures["native: kvledger apply by events (store_run), block events/s"]
        / figures["native: Dynamo apply, block events/s"]
    )
    figures["native: by hashes p50 ratio kvledger / Dynamo"] = (
        figures["native: kvledger lookup by hashes: p50 us"]
        / figures["native: Dynamo lookup by hashes: p50 us"]
    )
    return figures


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key:64s} {value:14,.2f}")
