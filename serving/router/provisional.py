"""Provisional holders: where routers said they sent a prompt, held until the engine's own
events confirm its blocks or a short window passes without them.

An engine's stored blocks reach the index after the request that made them is answered;
until then a prompt routed to an instance is invisible to every lookup, and the next turn
of the same conversation, or a replica of the router that did not route it, finds nothing
there. A :class:`Decision` ("prompt P went to instance I") makes I a provisional holder of
P's full blocks: lookups answer it beside the real holders, marked ``provisional``, for
``ttl_s`` seconds, or until a lookup finds I really holding as much.

A prompt is keyed by its full blocks, each key chaining the one before it
(:func:`token_keys`: Dynamo's local block hashes, under the LoRA adapter and cache salt,
chained with XXH3), or by the engine's own block hashes when a router knows them (they
chain already). Keys by tokens and keys by hashes live apart: a decision reported with one
answers lookups made with the same.

Bounded: at most ``max_blocks`` keys held at once (the oldest decisions give way first) and
``max_prompt_blocks`` per decision. Nothing here is durable or reaches the history: a
decision is a hint about the next seconds, never a residency.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from kvledger.schemas.decisions import Decision
from kvledger.schemas.dynamo import dynamo_block_hashes, dynamo_seed

try:
    from kvledger._core import dynamo_block_hashes as _native_hashes
except ImportError:  # built without a Rust toolchain
    _native_hashes = None  # type: ignore[assignment]

DEFAULT_TTL_S = 5.0
_PAIR = struct.Struct("<QQ")
_MASK = (1 << 64) - 1


def token_keys(
    tokens: Sequence[int], block_size: int, lora_name: str | None, cache_salt: str | None
) -> list[int]:
    """One key per full block of ``tokens``: the block's Dynamo local hash (under the LoRA
    adapter, as Dynamo's /query computes it) chained with the key before it (from the cache
    salt's), so a key names a whole prefix."""
    if _native_hashes is None or block_size <= 0:
        return chain_keys(dynamo_block_hashes(tokens, block_size, lora_name), cache_salt)
    if tokens and min(tokens) < 0:  # int32 ids as Dynamo's u32
        tokens = [t & 0xFFFFFFFF for t in tokens]
    return chain_keys(_native_hashes(tokens, block_size, dynamo_seed(lora_name)), cache_salt)


def chain_keys(locals_: Sequence[int], cache_salt: str | None = None) -> list[int]:
    """:func:`token_keys` from Dynamo local hashes already computed (the /query path has
    them)."""
    prev = xxhash.xxh3_64_intdigest(cache_salt.encode(), seed=1) if cache_salt else 0
    keys, digest, pack = [], xxhash.xxh3_64_intdigest, _PAIR.pack
    for local in locals_:
        prev = digest(pack(prev, local & _MASK))
        keys.append(prev)
    return keys


def hash_keys(hashes: Sequence[bytes]) -> list[int]:
    """Keys of a prompt given by the engine's block hashes (chained already)."""
    return [int.from_bytes(h[-8:], "big") for h in hashes]


@dataclass(slots=True)
class _Held:
    """One decision while it is held."""

    decision: Decision
    expires: float
    settled: bool = False  # confirmed, expired or pushed out: no longer in flight
    # Earlier decisions of the same instance whose blocks this one took over (the same
    # prompt sent there again): confirmed with it.
    shadowed: list[_Held] = field(default_factory=list)


@dataclass(slots=True)
class Stats:
    added: int = 0
    confirmed: int = 0
    expired: int = 0
    evicted: int = 0
    by_instance: dict[str, int] = field(default_factory=dict)  # in flight


Space = tuple[str, int, str]  # (model, group_idx, kind)


class Provisional:
    """The provisional holders of every prompt reported, in memory, thread-safe."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_blocks: int = 1_000_000,
        max_prompt_blocks: int = 16_384,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("the provisional window must be positive")
        self.ttl_s, self.max_blocks, self.max_prompt_blocks = ttl_s, max_blocks, max_prompt_blocks
        self.clock = clock
        self.lock = threading.Lock()
        # space -> key -> instance -> the latest decision holding it there
        self._spaces: dict[Space, dict[int, dict[str, _Held]]] = {}
        self._queue: deque[_Held] = deque()  # in order of expiry (one window for all)
        self._blocks = 0  # keys held, summed over the queue
        self.stats = Stats()

    def __len__(self) -> int:
        return len(self._queue)

    def empty(self, model: str, group_idx: int, kind: str) -> bool:
        """Whether no decision is held for this space (a lookup then pays nothing)."""
        return not self._spaces.get((model, group_idx, kind))

    # ------------------------------------------------------------------ writing
    def add(self, decision: Decision) -> int:
        """Hold ``decision`` for the window from now; the number of blocks it holds."""
        keys = decision.keys[: self.max_prompt_blocks]
        if not keys:
            return 0
        with self.lock:
            now = self.clock()
            self._expire(now)
            held = _Held(decision, now + self.ttl_s)
            space = self._spaces.setdefault((decision.model, decision.group_idx, decision.kind), {})
            for key in keys:
                at = space.setdefault(key, {})
                before = at.get(decision.instance)
                if before is not None and not before.settled and before not in held.shadowed:
                    held.shadowed += [before, *before.shadowed]  # kept flat
                    before.shadowed = []
                at[decision.instance] = held
            self._queue.append(held)
            self._blocks += len(keys)
            self.stats.added += 1
            flying = self.stats.by_instance
            flying[decision.instance] = flying.get(decision.instance, 0) + 1
            while self._blocks > self.max_blocks and len(self._queue) > 1:
                self._drop(self._queue.popleft(), "evicted")
        return len(keys)

    def expire(self) -> None:
        with self.lock:
            self._expire(self.clock())

    def _expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0].expires <= now:
            self._drop(queue.popleft(), "expired")

    def _drop(self, held: _Held, why: str) -> None:
        """Forget ``held`` (taken off the queue): its keys, where no later decision of the
        same instance holds them, and its place in flight."""
        d = held.decision
        keys = d.keys[: self.max_prompt_blocks]
        self._blocks -= len(keys)
        space = self._spaces.get((d.model, d.group_idx, d.kind))
        if space is not None:
            self._release(space, held)
            if not space:
                del self._spaces[(d.model, d.group_idx, d.kind)]
        if not held.settled:
            self._settle(held)
            setattr(self.stats, why, getattr(self.stats, why) + 1)

    def _release(self, space: dict[int, dict[str, _Held]], held: _Held) -> None:
        d = held.decision
        for key in d.keys[: self.max_prompt_blocks]:
            at = space.get(key)
            if at is not None and at.get(d.instance) is held:
                del at[d.instance]
                if not at:
                    del space[key]

    def _settle(self, held: _Held) -> None:
        held.settled = True
        flying, instance = self.stats.by_instance, held.decision.instance
        left = flying.get(instance, 0) - 1
        if left > 0:
            flying[instance] = left
        else:
            flying.pop(instance, None)

    # ------------------------------------------------------------------ reading
    def depths(
        self, model: str, group_idx: int, kind: str, keys: Sequence[int], real: dict[str, int]
    ) -> dict[str, int]:
        """How many leading blocks of the prompt keyed ``keys`` each instance is a
        provisional holder of, where that is more than ``real`` (instance -> blocks it
        really holds, from the index). A block it really holds counts toward the run; a
        decision the index now covers whole is settled (confirmed)."""
        with self.lock:
            self._expire(self.clock())
            space = self._spaces.get((model, group_idx, kind))
            if not space or not keys:
                return {}
            running: set[str] = set(real) | set(space.get(keys[0], ()))
            depth: dict[str, int] = {}
            confirmed: dict[int, _Held] = {}  # id -> a decision the index now covers
            for j, key in enumerate(keys):
                at = space.get(key)
                ended = []
                for instance in running:
                    held = at.get(instance) if at is not None else None
                    if held is not None:
                        if j == 0:
                            for each in self._covered(held, keys, real.get(instance, 0)):
                                confirmed[id(each)] = each
                        continue
                    if j < real.get(instance, 0):
                        continue
                    ended.append(instance)
                for instance in ended:
                    running.discard(instance)
                    depth[instance] = j
                if not running:
                    break
            for instance in running:
                depth[instance] = len(keys)
            self._confirm(confirmed.values(), (model, group_idx, kind))
            return {i: n for i, n in depth.items() if n > real.get(i, 0)}

    def _confirm(self, held: Iterable[_Held], where: tuple[str, int, str]) -> None:
        """The engine's events hold these decisions' prompts: the claims go."""
        space = self._spaces[where]
        for each in held:
            self._settle(each)
            self.stats.confirmed += 1
            self._release(space, each)
        if not space:
            del self._spaces[where]

    def _covered(self, held: _Held, keys: Sequence[int], really: int) -> list[_Held]:
        """The unsettled decisions of this instance at the prompt's first block whose whole
        prompt the index now shows it holding (``really`` leading blocks): confirmed."""
        covered = []
        for each in (held, *held.shadowed):
            whole = min(len(each.decision.keys), self.max_prompt_blocks)
            if (
                not each.settled
                and really >= whole
                # this prompt is the one it sent (keys chain)
                and keys[whole - 1 : whole] == [each.decision.keys[whole - 1]]
            ):
                covered.append(each)
        return covered

    def in_flight(self) -> dict[str, int]:
        """Decisions per instance still held and not confirmed: what was routed there in the
        last window that its engine has not shown yet."""
        with self.lock:
            self._expire(self.clock())
            return dict(self.stats.by_instance)
