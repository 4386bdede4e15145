"""Event streams as a topic would hold them, built in memory (no broker needed).

:class:`Stream` numbers each (source, group)'s messages as a publisher does and places them
on partitions by key; :func:`fleet_stream` is the simulated fleet's whole output.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvledger.consumer.inbound import Inbound
from kvledger.fleet import Fleet, FleetConfig, random_tokens, system_prompts
from kvledger.schemas.codec import SINGLE_OBJECT_MAGIC, Codec
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventsLost,
    Goodbye,
    GroupSpec,
    Heartbeat,
    KVEvent,
    group_of,
)
from kvledger.sinks import CollectingSink

T0_MS = 1_764_000_000_000
MODEL = "m"


@dataclass
class Stream:
    """Messages in topic order per partition (``messages`` in the order they were sent)."""

    topic: str = "events"
    partitions: int = 1
    codec: Codec = field(default_factory=Codec)
    messages: list[Inbound] = field(default_factory=list)
    _seq: dict[tuple[str, int, int], int] = field(default_factory=dict)
    _offsets: dict[int, int] = field(default_factory=dict)
    _clock: int = T0_MS

    def send(
        self,
        source: str,
        event: KVEvent,
        *,
        model: str = MODEL,
        epoch: int = 1,
        seq: int | None = None,
        time_ms: int | None = None,
    ) -> Inbound:
        """One envelope; ``seq`` defaults to the next number of its (source, group, epoch)."""
        group = group_of(event)
        if seq is None:
            seq = self._seq.get((source, group, epoch), 0)
        self._seq[(source, group, epoch)] = seq + 1
        self._clock += 1
        env = Envelope(source, model, 0, epoch, seq, time_ms or self._clock, event)
        return self.raw(self.codec.encode(env), f"{source}/{group}".encode())

    def raw(self, value: bytes, key: bytes = b"raw/0") -> Inbound:
        partition = zlib.crc32(key) % self.partitions
        offset = self._offsets.get(partition, 0)
        self._offsets[partition] = offset + 1
        message = Inbound(self.topic, partition, offset, key, value)
        self.messages.append(message)
        return message


def spec(
    group: int = 0, kind: str = "full_attention", block: int = 4, hash_size: int = 4
) -> GroupSpec:
    return GroupSpec(MODEL, group, kind, block, hash_size)


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def stored(
    hashes: Sequence[int],
    *,
    start: int | None = 0,
    size: int = 4,
    parent: int | None = None,
    medium: str | None = "CPU",
    group: int | None = 0,
    ownership: str | None = None,
    partial: bool = False,
    salt: int = 0,
    lora: str | None = None,
) -> BlockStored:
    """A BlockStored whose token ids are derived from the hash numbers (and ``salt``)."""
    tokens = tuple(x * 100 + j + salt for x in hashes for j in range(size))
    return BlockStored(
        tuple(h(x) for x in hashes), h(parent) if parent is not None else None, tokens, size,
        None, medium, lora, group_idx=group, ownership=ownership, token_start=start,
        partial=partial,
    )  # fmt: skip


def removed(
    hashes: Sequence[int], medium: str | None = "CPU", group: int | None = 0,
    ownership: str | None = None,
) -> BlockRemoved:  # fmt: skip
    return BlockRemoved(tuple(h(x) for x in hashes), medium, group, ownership=ownership)


def cleared(medium: str | None = "CPU", group: int | None = None) -> AllBlocksCleared:
    return AllBlocksCleared(group_idx=group, medium=medium)


def partition_order(messages: Sequence[Inbound]) -> list[Inbound]:
    """The messages partition after partition (another valid interleaving of the topic)."""
    return sorted(messages, key=lambda m: (m.partition, m.offset))


def fleet_stream(config: FleetConfig, partitions: int = 3, topic: str = "fleet") -> Stream:
    """Everything a simulated fleet publishes, each instance's events in its order."""
    sinks: dict[str, CollectingSink] = {}

    def sink(instance: str) -> CollectingSink:
        sinks[instance] = CollectingSink(config.model)
        return sinks[instance]

    Fleet(config, sink).run()
    stream = Stream(topic, partitions)
    # Interleave instances round-robin, as concurrent engines would.
    queues = {source: list(s.events) for source, s in sinks.items()}
    while any(queues.values()):
        for source, queue in queues.items():
            if queue:
                stream.send(source, queue.pop(0), model=config.model)
    return stream


def edge_stream() -> Stream:
    """Every rule's edge cases, three sources on three partitions."""
    s = Stream(partitions=3)
    a, b, c = "engine-a", "engine-b", "engine-c"
    for source in (a, b, c):
        s.send(source, spec(0, block=8, hash_size=4))
        s.send(source, spec(1, kind="sliding_window"))
    s.send(a, GroupSpec("m", 0, "full_attention", 16, 4))  # spec_conflict
    for i in range(6):
        s.send(a, stored([i, i + 1], size=8, start=16 * i))
        s.send(b, stored([i], size=8, start=16 * i, medium="GPU"))
        s.send(b, stored([i + 100], size=4, start=8, partial=True))
        s.send(c, stored([i], size=8, start=16 * i, medium="STORAGE", ownership="disk"))
    placeholder = stored([50], group=1)
    s.send(a, type(placeholder)((h(50),), None, (), 0, None, "CPU", None, group_idx=1))
    s.send(b, stored([50], group=1, start=4))  # upgrades the placeholder row
    s.send(a, stored([1], size=8, start=16, salt=3))  # hash_conflict
    s.send(a, stored([9], size=16))  # block_size_mismatch
    s.send(a, stored([9], group=7, size=4))  # unknown_group (until declared)
    s.send(b, removed([9], group=7))  # unknown_group (until declared)
    s.send(a, removed([0, 1, 1, 1]))  # the third and fourth are no-ops
    s.send(a, stored([3], size=8, start=48), seq=3)  # a duplicate
    s.send(a, stored([4], size=8, start=64), seq=40)  # a gap
    s.send(b, cleared(medium="GPU"))  # every group
    s.send(c, stored([20], size=8, start=0, medium="STORAGE", ownership="disk"), epoch=2, seq=0)
    s.send(c, stored([21], size=8, start=8), epoch=1, seq=99)  # stale_epoch
    s.send(c, stored([22], size=8, start=0, medium="GPU"), epoch=2)
    s.send(c, EventsLost(7, 9, group_idx=0), epoch=2)  # every tier and ownership of group 0
    s.send(c, EventsLost(5, 2, group_idx=0), epoch=2)  # invalid_event: not a range
    s.send(b, cleared(medium="CPU", group=0))
    s.raw(b"\x00\x01 not avro")  # undecodable
    s.raw(SINGLE_OBJECT_MAGIC + bytes(8) + b"\x02")  # unknown_schema
    s.send(a, stored([5, 6], size=8, start=80))
    s.send(a, stored([60, 61], size=8, start=None))  # vLLM: no position; the root starts at 0
    s.send(a, stored([63], size=8, start=None, parent=62))  # parent unknown: position unknown
    s.send(b, stored([62], size=8, start=None, parent=61))  # ends at 24
    s.send(b, stored([63], size=8, start=24, parent=62))  # the unknown position becomes known
    s.send(a, removed([5], medium="CPU"))
    s.send(a, Heartbeat(group_idx=0, interval_ms=5000, requests_running=2, requests_waiting=1))
    s.send(b, stored([30], size=8, start=0, medium="GPU"))
    s.send(b, stored([31], size=8, start=0, medium="STORAGE", ownership="disk"))
    s.send(b, Goodbye(group_idx=0))  # GPU and CPU end "closed" in every group
    s.send(b, stored([32], size=8, start=8, medium="GPU"))  # back after its goodbye
    keep_cpu = dataclasses.replace(spec(0, block=8, hash_size=4), surviving_media=("CPU",))
    s.send(a, keep_cpu, epoch=3, seq=0)  # a restart that keeps CPU (and ends STORAGE)
    # A source that reports reused blocks as stores: a report adds no copy of a held block.
    d = "engine-d"
    s.send(d, dataclasses.replace(spec(0, block=8, hash_size=4), reports_reuse=True))
    s.send(d, stored([70, 71], size=8, start=0, medium="GPU"))
    s.send(d, stored([70, 71, 72], size=8, start=0, medium="GPU"))  # 70, 71: reported reuse
    s.send(d, removed([70, 72], medium="GPU"))  # 71 stays, held once
    # vLLM 0.34's state checkpoints in a recurrent group: one hash, its parent, no tokens.
    s.send(d, spec(2, kind="mamba", block=8, hash_size=4))
    s.send(d, checkpoint(70, parent=None, size=8, group=2))
    s.send(d, checkpoint(72, parent=71, size=8, group=2))
    s.send(d, checkpoint(73, parent=72, size=4, group=2, partial=True))  # a partial tail's
    s.send(d, type(placeholder)((h(74),), None, (), 0, None, "CPU", None, group_idx=2))
    s.send(d, checkpoint(74, parent=73, size=8, group=2))  # upgrades the placeholder row
    s.send(d, removed([72], group=2))
    s.send(d, checkpoint(75, parent=74, size=8, group=2, hashes=2))  # invalid_event: two
    s.send(d, checkpoint(76, parent=71, size=8, group=0))  # token_count_mismatch: attention
    return s


def checkpoint(
    x: int, *, parent: int | None, size: int, group: int, partial: bool = False, hashes: int = 1
) -> BlockStored:
    """vLLM 0.34's payload for a recurrent group's offloaded chunk: the state at hash ``x``
    (``hashes`` > 1: a malformed one), chained to ``parent``, a block size and no tokens."""
    return BlockStored(
        tuple(h(x + i) for i in range(hashes)), h(parent) if parent is not None else None, (),
        size, None, "CPU", None, group_idx=group, partial=partial,
    )  # fmt: skip


def fleet_prompts(config: FleetConfig, count: int, seed: int) -> list[list[int]]:
    """Prompts a router would send a fleet: a system prompt cut anywhere (the whole, none),
    then a tail of fresh tokens of 0, 16, 40 or 300."""
    rng, systems = random.Random(seed), system_prompts(config)
    out = []
    for _ in range(count):
        base = rng.choice(systems)
        cut = rng.randrange(0, len(base) + 1)
        out.append(base[:cut] + random_tokens(rng, rng.choice([0, 16, 40, 300])))
    return out


def messy_stream(seed: int) -> Stream:
    """Random stores, removals and lifecycle over few hashes, so that stores meet rows of
    the same and of other content, placeholders, partial tails, LoRA names, reuse reports,
    gaps, duplicates, restarts, clears and heartbeats."""
    rng, s = random.Random(seed), Stream(partitions=2)
    sources = ["e0", "e1", "e2"]
    epochs = dict.fromkeys(sources, 1)
    for source in sources:
        reports = rng.random() < 0.3
        s.send(source, dataclasses.replace(spec(0, block=4, hash_size=2), reports_reuse=reports))
        s.send(source, spec(1, kind="sliding_window"))
    for _ in range(400):
        source = rng.choice(sources)
        epoch = epochs[source]
        medium = rng.choice(["GPU", "CPU"])
        roll = rng.random()
        if roll < 0.45:
            n = rng.randint(1, 4)
            first = rng.randrange(12)
            hashes = [first + k for k in range(n)]
            if rng.random() < 0.05:
                hashes.append(hashes[0])  # a hash twice
            parent = first - 1 if first and rng.random() < 0.7 else None
            start = rng.choice([None, 4 * first, 4 * first + 4])
            partial = rng.random() < 0.1
            event = stored(
                hashes, start=start, size=2 if partial else 4, parent=parent, medium=medium,
                partial=partial, salt=rng.choice([0, 0, 0, 1]),
                lora=rng.choice([None, None, "a", "b"]),
            )  # fmt: skip
            if rng.random() < 0.05:
                event = dataclasses.replace(event, extra_keys=('["s"]',) + (None,) * (n - 1))
            s.send(source, event, epoch=epoch)
        elif roll < 0.55:
            first = rng.randrange(30, 36)
            placeholder = BlockStored(
                (first.to_bytes(8, "big"), (first + 1).to_bytes(8, "big")), None, (), 0, None,
                medium, None, group_idx=1,
            )  # fmt: skip
            s.send(source, placeholder, epoch=epoch)
        elif roll < 0.85:
            hashes = [rng.randrange(14) for _ in range(rng.randint(1, 3))]
            s.send(source, removed(hashes, medium=medium), epoch=epoch)
        elif roll < 0.88:
            s.send(source, cleared(medium=medium, group=0), epoch=epoch)
        elif roll < 0.91:
            epochs[source] += 1
            s.send(source, spec(0, block=4, hash_size=2), epoch=epochs[source], seq=0)
        elif roll < 0.94:
            # every other one with the engine's load (from the stream's length: no rng call)
            n = len(s.messages)
            load = (n % 7, n % 3) if n % 2 else (None, None)
            s.send(source, Heartbeat(0, 1000, *load), epoch=epoch)
        elif roll < 0.97:
            last = s._seq.get((source, 0, epoch), 0)
            s.send(source, stored([rng.randrange(12)], medium=medium), epoch=epoch,
                   seq=max(0, last - rng.randint(0, 2)))  # fmt: skip  # a duplicate
        else:
            last = s._seq.get((source, 0, epoch), 0)
            s.send(source, removed([rng.randrange(12)], medium=medium), epoch=epoch,
                   seq=last + rng.randint(2, 5))  # fmt: skip  # a gap
    return s
