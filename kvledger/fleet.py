"""A deterministic simulated fleet of engines that offload KV-cache chunks (for the demo,
tests and benchmarks).

Each instance serves requests that start with one of a few fleet-wide system prompts, then a
user suffix. Per request (one scheduler step) it:

- looks up the prompt's full chunks on its CPU tier from the start (hits register the primary
  residency; chunks found only on the STORAGE tier are promoted back to CPU);
- stores the missed full chunks on CPU, and the partial recurrent tail when the prompt ends
  inside a chunk (re-announcing hashes shared with other tails);
- stores the last chunks of a sliding-window group (placeholder payloads, as vLLM does);
- evicts least-recently-used chunks past the CPU capacity, first demoting some of them to a
  secondary STORAGE tier (ownership ``disk``, ``removal_expected``), which has its own bound.

Group 0 is full attention with 16-token hashes, 32-token blocks and 64-token chunks; group 1 is
a sliding-window group. The optional misconfigured source announces 32-token blocks for
group 0 but tracks 16-token blocks, so its stores disagree with its announced spec.

Block hashes are real vLLM sha256 hashes of the tokens (schemas.hashing), so the same prefix
has the same hashes on every instance.
"""

from __future__ import annotations

import random
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvledger.producer.tracker import (
    GroupOffloadConfig,
    Locality,
    Medium,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadKey,
    group_announcement,
    make_offload_key,
)
from kvledger.schemas.events import BlockRemoved, BlockStored, KVEvent
from kvledger.schemas.hashing import prompt_block_hashes
from kvledger.sinks import EventSink

TOKENS_PER_HASH = 16
FULL_GROUP = GroupOffloadConfig(
    group_idx=0,
    tokens_per_block=32,
    tokens_per_chunk=64,
    hashes_per_chunk=4,
    kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None),
)
SLIDING_GROUP = GroupOffloadConfig(
    group_idx=1,
    tokens_per_block=32,
    tokens_per_chunk=64,
    hashes_per_chunk=4,
    kv_event_group_spec=OffloadingEventGroupSpec("sliding_window", 1024),
    sliding_window_size_in_chunks=16,
)
MISCONFIGURED_FULL_GROUP = FULL_GROUP._replace(tokens_per_block=16)
MISCONFIGURED_ID = "engine-misconfigured"  # the misconfigured source's instance id
SLIDING_CHUNKS_STORED = 2
STORAGE_OWNER = "disk"
VOCAB = 65536  # token ids are drawn as 16-bit values
DEFAULT_MODEL = "sim-llama-8b"


@dataclass(frozen=True, slots=True)
class FleetConfig:
    instances: int = 4
    requests: int = 100  # per instance
    seed: int = 0
    model: str = DEFAULT_MODEL
    system_prompts: int = 6
    system_prompt_tokens: tuple[int, int] = (200, 1200)
    suffix_tokens: tuple[int, int] = (16, 900)
    cpu_capacity_chunks: int = 128
    storage_capacity_chunks: int = 192
    demote_fraction: float = 0.5
    misconfigured_source: bool = False
    hash_algorithm: str = "sha256"
    # GPU block-pool events (as vLLM's pool publishes them) for each request's full blocks,
    # with an LRU bound of this many blocks per engine; 0: no GPU tier.
    gpu_capacity_blocks: int = 0
    # (instance, requests): that engine restarts after serving that many requests (a crash:
    # a new publisher epoch, empty GPU and CPU tiers, STORAGE kept).
    restart: tuple[str, int] | None = None


@dataclass
class FleetSummary:
    requests: int = 0
    messages: int = 0
    lookup_hits: int = 0
    promotions: int = 0
    partial_tails: int = 0
    restarts: int = 0
    instances: list[str] = field(default_factory=list)
    last_prompt: list[int] = field(default_factory=list)  # the token ids last served


@dataclass(slots=True)
class _Request:
    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: None = None


class SimulatedEngine:
    """One engine instance: a CPU tier and a STORAGE tier with LRU bounds."""

    def __init__(
        self, instance_id: str, sink: EventSink, config: FleetConfig, prompts: Sequence[list[int]]
    ) -> None:
        self.instance_id = instance_id
        self.sink = sink
        self.config = config
        self.prompts = prompts
        self.rng = random.Random(f"{config.seed}/{instance_id}")  # its own, from the seed
        misconfigured = instance_id == MISCONFIGURED_ID
        self.full = MISCONFIGURED_FULL_GROUP if misconfigured else FULL_GROUP
        self.misconfigured = misconfigured
        self.cpu: OrderedDict[OffloadKey, None] = OrderedDict()
        self.storage: OrderedDict[OffloadKey, None] = OrderedDict()
        self.gpu: OrderedDict[bytes, None] = OrderedDict()
        self.served = 0
        self._announce()

    def _announce(self) -> None:
        if self.misconfigured:
            self.sink.announce_group_spec(group_announcement(self.config.model, FULL_GROUP))
            self.sink.announce_groups([SLIDING_GROUP])
        else:
            self.sink.announce_groups([FULL_GROUP, SLIDING_GROUP])

    def restart(self, sink: EventSink) -> None:
        """The engine process died and came back: a new sink (a new epoch), empty GPU and
        CPU tiers; its STORAGE tier is still there."""
        close = getattr(self.sink, "close", None)
        if close is not None:
            close(goodbye=False)  # a crash says nothing
        self.sink = sink
        self.cpu.clear()
        self.gpu.clear()
        self._announce()

    def _gpu_blocks(self, raw: list[bytes], tokens: list[int]) -> list[KVEvent]:
        """The GPU pool computes the prompt's full blocks: new ones are stored, the least
        recently used leave past the bound."""
        size = self.full.tokens_per_block
        per = size // TOKENS_PER_HASH
        stored, parents = [], []
        for j in range(len(raw) // per):
            block = raw[(j + 1) * per - 1]
            if block in self.gpu:
                self.gpu.move_to_end(block)
                continue
            self.gpu[block] = None
            stored.append(j)
            parents.append(raw[j * per - 1] if j else None)
        events: list[KVEvent] = []
        for j, parent in zip(stored, parents, strict=True):
            block_tokens = tuple(tokens[j * size : (j + 1) * size])
            block = raw[(j + 1) * per - 1]
            stored_event = BlockStored(
                (block,),
                parent,
                block_tokens,
                size,
                None,
                "GPU",
                None,
                group_idx=self.full.group_idx,
                token_start=j * size,
            )
            events.append(stored_event)
        evicted = []
        while len(self.gpu) > self.config.gpu_capacity_blocks:
            evicted.append(self.gpu.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(tuple(evicted), "GPU", self.full.group_idx))
        return events

    def step(self, summary: FleetSummary) -> None:  # noqa: C901, PLR0912, PLR0915 - one request's life, in order
        """Serve one request: lookups, stores, partial tail, sliding window, evictions."""
        cfg = self.config
        prompt = self.prompts[self.rng.randrange(len(self.prompts))]
        suffix_len = self.rng.randint(*cfg.suffix_tokens)
        tokens = prompt + random_tokens(self.rng, suffix_len)
        raw = prompt_block_hashes(tokens, TOKENS_PER_HASH, cfg.hash_algorithm)
        req = _Request(block_hashes=raw, all_token_ids=tokens)
        tracker = self.sink.tracker
        full = self.full
        hashes_per_chunk = full.hashes_per_chunk
        num_chunks = len(raw) // hashes_per_chunk
        events: list[OffloadingEvent] = []

        def chunk_key(chunk: int, group: int) -> OffloadKey:
            return make_offload_key(raw[(chunk + 1) * hashes_per_chunk - 1], group)

        # 1. Lookups from the start until the first miss.
        hits = 0
        for chunk in range(num_chunks):
            key = chunk_key(chunk, full.group_idx)
            if key in self.cpu:
                tracker.record_lookup(req, full, chunk, key)
                self.cpu.move_to_end(key)
            elif key in self.storage:
                tracker.record_lookup(req, full, chunk, key)
                events.append(OffloadingEvent([key], Medium.CPU, removed=False))
                self.cpu[key] = None
                self.storage.move_to_end(key)
                summary.promotions += 1
            else:
                break
            hits += 1
        summary.lookup_hits += hits

        # 2. Stores of the missed full chunks.
        stored: list[OffloadKey] = []
        for chunk in range(hits, num_chunks):
            key = chunk_key(chunk, full.group_idx)
            tracker.record_store(req, full, chunk, key)
            self.cpu[key] = None
            stored.append(key)
        if stored:
            events.append(OffloadingEvent(stored, Medium.CPU, removed=False))

        # 3. The partial recurrent tail, when the prompt ends inside a chunk.
        boundary = len(raw) * TOKENS_PER_HASH
        if boundary % full.tokens_per_chunk:
            key = make_offload_key(raw[boundary // TOKENS_PER_HASH - 1], full.group_idx)
            if key in self.cpu:
                tracker.record_partial_lookup(req, full, boundary, key)
                self.cpu.move_to_end(key)
            else:
                tracker.record_partial_store(req, full, boundary, key)
                self.cpu[key] = None
                events.append(OffloadingEvent([key], Medium.CPU, removed=False))
                summary.partial_tails += 1

        # 4. The sliding-window group keeps only its last chunks.
        window_keys = [
            chunk_key(chunk, SLIDING_GROUP.group_idx)
            for chunk in range(max(0, num_chunks - SLIDING_CHUNKS_STORED), num_chunks)
        ]
        new_window = [k for k in window_keys if k not in self.cpu]
        for key in window_keys:
            tracker.record_store(req, SLIDING_GROUP, 0, key)  # records nothing: placeholder
            self.cpu[key] = None
        if new_window:
            events.append(OffloadingEvent(new_window, Medium.CPU, removed=False))

        # 5. Evictions past the CPU bound, demoting some chunks to STORAGE first.
        evicted: list[OffloadKey] = []
        while len(self.cpu) > cfg.cpu_capacity_chunks:
            key, _ = self.cpu.popitem(last=False)
            if key not in self.storage and self.rng.random() < cfg.demote_fraction:
                events.append(
                    OffloadingEvent(
                        [key],
                        Medium.STORAGE,
                        removed=False,
                        locality=Locality.LOCAL,
                        ownership=STORAGE_OWNER,
                        removal_expected=True,
                    )
                )
                self.storage[key] = None
            evicted.append(key)
        if evicted:
            events.append(OffloadingEvent(evicted, Medium.CPU, removed=True))
        dropped: list[OffloadKey] = []
        while len(self.storage) > cfg.storage_capacity_chunks:
            key, _ = self.storage.popitem(last=False)
            dropped.append(key)
        if dropped:
            events.append(
                OffloadingEvent(
                    dropped,
                    Medium.STORAGE,
                    removed=True,
                    locality=Locality.LOCAL,
                    ownership=STORAGE_OWNER,
                )
            )
        summary.messages += self.sink.publish(events)
        if cfg.gpu_capacity_blocks and not self.misconfigured:
            summary.messages += self.sink.publish_events(self._gpu_blocks(raw, tokens))
        summary.requests += 1
        summary.last_prompt = tokens
        self.served += 1


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """``count`` token ids in [0, VOCAB), deterministic for the generator's state."""
    return array("H", rng.randbytes(2 * count)).tolist()


def system_prompts(config: FleetConfig) -> list[list[int]]:
    """The fleet-wide system prompts of a configuration (deterministic for its seed)."""
    rng = random.Random(config.seed)
    low, high = config.system_prompt_tokens
    return [random_tokens(rng, rng.randint(low, high)) for _ in range(config.system_prompts)]


def prompt_hashes(
    tokens: list[int], config: FleetConfig, int64: bool = True, per_hash: bool = False
) -> list[bytes]:
    """Group 0's block hashes of a prompt, as a router computes them (vLLM sha256); with
    ``per_hash``, every hash at the hash size (TOKENS_PER_HASH tokens) instead."""
    raw = prompt_block_hashes(tokens, TOKENS_PER_HASH, config.hash_algorithm)
    scale = 1 if per_hash else FULL_GROUP.tokens_per_block // TOKENS_PER_HASH
    blocks = raw[scale - 1 :: scale]
    return [h[-8:] for h in blocks] if int64 else blocks


def instance_ids(config: FleetConfig) -> list[str]:
    ids = [f"engine-{i}" for i in range(config.instances)]
    if config.misconfigured_source:
        ids.append(MISCONFIGURED_ID)
    return ids


class Fleet:
    """Builds the engines (one sink each) and runs their requests round-robin."""

    def __init__(self, config: FleetConfig, sink_factory: Callable[[str], EventSink]) -> None:
        self.config = config
        self.sink_factory = sink_factory
        prompts = system_prompts(config)
        self.engines = [
            SimulatedEngine(iid, sink_factory(iid), config, prompts) for iid in instance_ids(config)
        ]

    def run(
        self,
        progress: Callable[[int, int], None] | None = None,
        rate: float | None = None,
    ) -> FleetSummary:
        """Serve every request; ``rate`` paces publishing to that many messages per second."""
        summary = FleetSummary(instances=[e.instance_id for e in self.engines])
        total = self.config.requests * len(self.engines)
        done = 0
        start = time.monotonic()
        restart = self.config.restart
        for _ in range(self.config.requests):
            for engine in self.engines:
                if restart == (engine.instance_id, engine.served):
                    engine.restart(self.sink_factory(engine.instance_id))
                    summary.restarts += 1
                engine.step(summary)
                done += 1
                if progress is not None:
                    progress(done, total)
                if rate:
                    ahead = summary.messages / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
        return summary
