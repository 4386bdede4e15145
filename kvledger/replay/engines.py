"""Simulated engines faithful to vLLM's caches, and the time model that gives their TTFT.

Each engine has a GPU prefix cache and a CPU offload tier, both LRU over blocks with a
capacity in blocks:

- a request's prompt is matched from its first block: the run held on the GPU, then the run
  that continues it on the CPU (loaded back, as vLLM's OffloadingConnector loads a hit);
  at least the prompt's last token is computed (vLLM never serves a whole prompt from cache);
- when its prefill ends every full block of the prompt is on the GPU (stores for those it did
  not hold there) and on the CPU (the connector offloads each block the request computed or
  loaded, stores for those new there); blocks past a tier's capacity leave it, least
  recently used first (removals). A request's blocks are touched last-first, so a chain's tail
  goes before its head (vLLM frees a request's blocks in reverse order);
- one prefill runs at a time, first come first served.

A dispatched request is played at once (the engine's cache after it is known as soon as its
place in the queue is), and what changed is a :class:`Change` stamped with the instant its
prefill ends: the fleet releases changes in time order (fleet.py), which is when the engine
publishes them and when anyone may know them.

The time model (:class:`TimeModel`), per request: queue wait, then ``prefill_s_per_token``
for each recomputed token plus ``load_s_per_block`` for each block loaded from the CPU;
decode is not modelled (Mooncake's prefill pool hands decoding to other nodes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass

GPU, CPU = "GPU", "CPU"


@dataclass(frozen=True)
class TimeModel:
    """Seconds a prefill takes. The defaults, from published figures for a 70 B model
    (LLaMA-2-70B's shape: 80 layers, 8 KV heads of 128) on one node of 8 A100/A800-class GPUs:

    - ``prefill_s_per_token`` 112 µs: 2 x 70e9 FLOPs per token (the dense forward pass)
      over 8 x 312 TFLOP/s (the A100 datasheet's dense BF16 peak) at 50% utilisation;
    - ``load_s_per_block`` 0.84 ms: a 512-token block's KV cache is 2 x 80 x 8 x 128 x 2 B
      x 512 = 160 MiB, moved over 8 PCIe 4.0 x16 links at 25 GB/s each;
    - ``slo_s``: the TTFT counted as within the service's objective.
    """

    prefill_s_per_token: float = 112e-6
    load_s_per_block: float = 0.84e-3
    slo_s: float = 5.0

    def prefill_s(self, computed_tokens: int, loaded_blocks: int) -> float:
        return computed_tokens * self.prefill_s_per_token + loaded_blocks * self.load_s_per_block


def held_run(ids: tuple[int, ...], held: Container[int], start: int = 0) -> int:
    """How far the run of ``ids`` from ``start`` that ``held`` holds goes (an index into
    ``ids``): a prefix match on one tier."""
    n = start
    while n < len(ids) and ids[n] in held:
        n += 1
    return n


def engine_hash(block: int) -> int:
    """The engine's int hash of a trace block id (vLLM's wire form; never 0): what its
    events carry, and what Dynamo's tree and kvledger's index are asked by."""
    return block + 1


def hash_key(block: int) -> bytes:
    """The index's key of a trace block id (the int hash's 8 big-endian bytes)."""
    return engine_hash(block).to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class Change:
    """Blocks that became resident on (``stored``) or left (not) one tier of one engine.
    A stored run is a chain: ``parent`` is the id before its first block (None: the prompt's
    start)."""

    medium: str
    stored: bool
    ids: tuple[int, ...]
    parent: int | None = None


@dataclass(frozen=True, slots=True)
class Served:
    """What one request cost on the engine that served it."""

    engine: int
    arrived: float  # seconds of trace time
    started: float
    first_token: float  # the prefill's end
    tokens: int
    gpu_tokens: int
    cpu_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrived

    @property
    def computed_tokens(self) -> int:
        return self.tokens - self.gpu_tokens - self.cpu_tokens


class Tier:
    """An LRU set of block ids with a capacity in blocks."""

    def __init__(self, medium: str, capacity: int) -> None:
        self.medium = medium
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()  # least recent first

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def prefix(self, ids: tuple[int, ...], start: int = 0) -> int:
        """How far the run of held ids from ``start`` goes (an index into ``ids``)."""
        return held_run(ids, self.blocks, start)

    def keep(self, ids: tuple[int, ...]) -> list[Change]:
        """Touch or store every id (the chain's head most recent), then evict past the
        capacity; the stores (one per run of new ids) and the removals."""
        changes: list[Change] = []
        run_start: int | None = None
        for i, block in enumerate(ids):
            if block in self.blocks:
                if run_start is not None:
                    changes.append(self._stored(ids, run_start, i))
                    run_start = None
            elif run_start is None:
                run_start = i
        if run_start is not None:
            changes.append(self._stored(ids, run_start, len(ids)))
        blocks = self.blocks
        for block in reversed(ids):
            blocks[block] = None
            blocks.move_to_end(block)
        evicted: list[int] = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if evicted:
            changes.append(Change(self.medium, False, tuple(evicted)))
        return changes

    def _stored(self, ids: tuple[int, ...], a: int, b: int) -> Change:
        return Change(self.medium, True, ids[a:b], ids[a - 1] if a else None)


@dataclass
class Engine:
    """One simulated engine: its tiers and its prefill queue (see the module docstring)."""

    index: int
    gpu: Tier
    cpu: Tier | None
    model: TimeModel
    block_tokens: int
    free_at: float = 0.0  # when its queue empties (trace seconds)
    served: int = 0

    def hit(self, ids: tuple[int, ...]) -> tuple[int, int]:
        """(blocks held on the GPU from the start, blocks after them held on the CPU)."""
        g = self.gpu.prefix(ids)
        c = self.cpu.prefix(ids, g) if self.cpu is not None else g
        return g, c - g

    def serve(self, ids: tuple[int, ...], tokens: int, now: float) -> tuple[Served, list[Change]]:
        """Queue one request arriving at ``now`` whose full blocks are ``ids``: what it cost,
        and what its prefill changed in the caches (as of its end)."""
        gpu_tokens, cpu_tokens, prefill = cached_split(*self.hit(ids), tokens, self)
        started = max(now, self.free_at)
        done = started + prefill
        self.free_at = done
        self.served += 1
        changes = self.gpu.keep(ids)
        if self.cpu is not None:
            changes += self.cpu.keep(ids)
        return Served(self.index, now, started, done, tokens, gpu_tokens, cpu_tokens), changes

    def queued_s(self, now: float) -> float:
        """Seconds of prefill queued ahead of a request arriving now."""
        return max(0.0, self.free_at - now)

    def ttft(self, ids: tuple[int, ...], tokens: int, now: float) -> float:
        """The TTFT a request would have here now (the engine's true state)."""
        return self.queued_s(now) + cached_split(*self.hit(ids), tokens, self)[2]


def cached_split(gpu: int, cpu: int, tokens: int, engine: Engine) -> tuple[int, int, float]:
    """A prompt of ``tokens`` with ``gpu`` leading blocks held on the GPU and ``cpu`` more
    on the CPU: (tokens from the GPU, tokens loaded from the CPU, the prefill's seconds).
    At least the last token is computed."""
    bt, most = engine.block_tokens, max(tokens - 1, 0)
    gpu_tokens = min(gpu * bt, most)
    cpu_tokens = min((gpu + cpu) * bt, most) - gpu_tokens
    loaded = -(-cpu_tokens // bt)
    return gpu_tokens, cpu_tokens, engine.model.prefill_s(tokens - gpu_tokens - cpu_tokens, loaded)
