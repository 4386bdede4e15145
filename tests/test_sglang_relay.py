"""`kvledger relay --engine sglang` against SGLang's own publisher (SGLang 0.5.23's
``ZmqEventPublisher`` and event classes from its wheel: tests/helpers/sglang_wheel.py),
over real ZMQ sockets, into real Kafka and a real PostgreSQL index.

One engine's scripted life: prefix sharing, offload to CPU_PINNED, DISK and EXTERNAL,
eviction, a LoRA adapter, a salted request, signed 64-bit hashes, the relay started late
(the start is replayed), an engine restart (a new epoch: GPU and CPU end, storage
survives) and a gap past the replay buffer (recorded lost: the engine's blocks are
cleared). The index ends equal to the truth built from what the engine published; token
lookups find its plain and LoRA prefixes and never its salted ones.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest

from kvledger.consumer.db import connect
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.relay import Relay
from kvledger.producer.relay.sglang import MEDIA
from kvledger.serving.lookup import PrefixIndex
from tests.helpers.consuming import consume, lost_ranges, residencies_of
from tests.helpers.procs import free_port
from tests.helpers.sglang_wheel import sglang_kv_events

pytestmark = pytest.mark.integration

MODEL, PAGE, SOURCE, LORA = "m", 4, "sgl-0", "adapter-s"
HOUR = timedelta(hours=1)
Key = tuple[int, bytes, str, str]  # group, hash, medium, ownership


def signed(h: int) -> int:
    """A hash as SGLang publishes it: a signed 64-bit int."""
    return h - (1 << 64) if h >= 1 << 63 else h


class Life:
    """One SGLang engine's publisher and what it published: (incarnation, seq, events)."""

    def __init__(self, kv: ModuleType, buffer_steps: int) -> None:
        self.kv = kv
        self.port, self.replay = free_port(), free_port()
        self.sent: list[tuple[int, int, list[Any]]] = []
        self.incarnation, self.seq = 0, 0
        self.rng = random.Random(12)
        self.next_hash = 1
        self.pages: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, tokens)
        self.publisher = self._start(buffer_steps)

    def _start(self, buffer_steps: int) -> Any:
        return self.kv.ZmqEventPublisher(
            attn_dp_rank=0, endpoint=f"tcp://*:{self.port}",
            replay_endpoint=f"tcp://*:{self.replay}", buffer_steps=buffer_steps,
        )  # fmt: skip

    def restart(self, buffer_steps: int) -> None:
        self.publisher.shutdown()
        time.sleep(0.3)
        self.publisher = self._start(buffer_steps)
        self.incarnation, self.seq = self.incarnation + 1, 0

    def send(self, *events: Any, ts: float | None = None, **batch: Any) -> int:
        """One batch (``ts``, ``batch``: what it says, as a sound engine would not)."""
        now = time.time() if ts is None else ts
        self.publisher.publish(self.kv.KVEventBatch(ts=now, events=list(events), **batch))
        self.sent.append((self.incarnation, self.seq, list(events)))
        self.seq += 1
        return self.seq - 1

    def _hash(self) -> int:
        self.next_hash += 1
        return signed((self.next_hash * 0x9E3779B97F4A7C15) % 2**64)  # half of them negative

    def request(self, shared: list[int] | None = None, *, lora: str | None = None,
                salt: str | None = None, medium: str = "GPU") -> list[int]:  # fmt: skip
        """A prompt of 3 new pages after ``shared`` (its hashes, already stored): stored."""
        hashes = [self._hash() for _ in range(3)]
        tokens = [self.rng.randrange(1, 30_000) for _ in range(3 * PAGE)]
        parent = shared[-1] if shared else None
        self.send(self.kv.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
            block_size=PAGE, lora_id=1 if lora else None, medium=medium, cache_salt=salt,
            session_id="sess-1", lora_name=lora,
        ))  # fmt: skip
        for i, h in enumerate(hashes):
            self.pages[h] = (hashes[i - 1] if i else parent, tokens[i * PAGE : (i + 1) * PAGE])
        return hashes

    def tokens(self, last: int) -> list[int]:
        """The prompt's tokens from the root to page ``last``."""
        out: list[int] = []
        at: int | None = last
        while at is not None:
            parent, tokens = self.pages[at]
            out[:0] = tokens
            at = parent
        return out

    def offload(self, hashes: list[int], medium: str) -> None:
        """Copies of stored pages on a lower tier (HiCache's write-through)."""
        self.send(self.kv.BlockStored(
            block_hashes=hashes, parent_block_hash=self.pages[hashes[0]][0],
            token_ids=[t for h in hashes for t in self.pages[h][1]], block_size=PAGE,
            lora_id=None, medium=medium,
        ))  # fmt: skip

    def evict(self, hashes: list[int], medium: str = "GPU") -> None:
        self.send(self.kv.BlockRemoved(block_hashes=hashes, medium=medium))


def truth(sent: list[tuple[int, int, list[Any]]], lost: set[tuple[int, int]]) -> dict[Key, int]:
    """The source's residencies after what was sent: a restart ends GPU and CPU, a lost
    batch ends everything (and is not applied)."""
    refs: Counter[Key] = Counter()
    incarnation, losing = 0, False
    for i, seq, events in sent:
        if i != incarnation:
            refs = Counter({k: v for k, v in refs.items() if k[2] == "STORAGE"})
            incarnation = i
        if (i, seq) in lost:
            if not losing:
                refs.clear()
            losing = True
            continue
        losing = False
        for e in events:
            name = type(e).__name__
            if name == "AllBlocksCleared":
                refs = Counter({k: v for k, v in refs.items() if k[2] != "GPU"})
                continue
            medium, ownership = MEDIA[e.medium]
            for h in e.block_hashes:
                key = (0, (h % 2**64).to_bytes(8, "big"), medium, ownership or "")
                refs[key] += 1 if name == "BlockStored" else -1
    return {k: v for k, v in refs.items() if v > 0}


@pytest.fixture
def kv() -> Iterator[ModuleType]:
    with sglang_kv_events() as module:
        yield module


def run_relay(life: Life, bootstrap: str, topic: str) -> Relay:
    relay = Relay(RelayConfig(
        endpoint=f"tcp://127.0.0.1:{life.port}", replay_endpoint=f"tcp://127.0.0.1:{life.replay}",
        source=SOURCE, model=MODEL, bootstrap_servers=bootstrap, topic=topic,
        groups=[parse_group(f"0:full_attention:{PAGE}", MODEL)], heartbeat_interval_s=1.0,
        engine="sglang",
    ))  # fmt: skip
    relay.start()
    assert relay.ready(60), "the relay did not resynchronise with SGLang's publisher"
    return relay


def relayed(relay: Relay, life: Life, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while relay.ranks[0].committed_seq != life.seq - 1:
        assert not relay.errors, relay.errors
        assert time.monotonic() < deadline, (relay.ranks[0].committed_seq, life.seq - 1)
        time.sleep(0.05)


def test_an_sglang_engines_life_through_the_relay_equals_the_truth(
    kafka_bootstrap: str, fresh_database: str, make_topic: Any, group_id: str, kv: ModuleType
) -> None:
    topic = make_topic("sglang", partitions=3)
    life = Life(kv, buffer_steps=64)
    relay = None
    lost: set[tuple[int, int]] = set()
    try:
        # Before the relay listens: it starts by replaying these.
        system = life.request()
        shared = life.request(system)  # prefix sharing: under the system prompt's pages
        life.request(system, lora=LORA)
        life.request(salt="tenant-7")
        relay = first_relay = run_relay(life, kafka_bootstrap, topic)
        life.offload(system, "CPU_PINNED")
        life.offload(shared, "DISK")
        life.offload(system[:1], "EXTERNAL")
        life.evict(shared)  # GPU eviction, its DISK copy kept
        life.evict(system[:1], "EXTERNAL")
        life.offload(system[:2], "EXTERNAL")
        life.request(system)
        relayed(relay, life)

        life.restart(buffer_steps=4)  # a new epoch: sequence from 0, an empty GPU
        life.request()
        kept = life.request(lora=LORA)
        relayed(relay, life)

        relay.stop()  # a gap past the buffer: 7 batches while nobody listens, 4 kept
        first = life.seq
        for _ in range(7):
            life.request(kept)
        lost |= {(life.incarnation, s) for s in range(first, life.seq - 4)}
        relay = run_relay(life, kafka_bootstrap, topic)
        plain, adapted = life.request(), life.request(lora=LORA)
        salted = life.request(salt="tenant-7")
        life.offload(plain, "CPU_PINNED")
        life.offload(plain[:2], "DISK")
        life.offload(plain[:1], "EXTERNAL")
        relayed(relay, life)
    finally:
        if relay is not None:
            relay.stop()
        life.publisher.shutdown()
    assert first_relay.metrics.engine_restarts.labels(SOURCE)._value.get() == 1

    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    got, ranges = residencies_of(fresh_database, SOURCE), lost_ranges(fresh_database, SOURCE)
    want = truth(life.sent, lost)
    with connect(fresh_database, autocommit=True) as conn:
        salts = conn.execute(
            "SELECT count(*) FROM kvledger.blocks WHERE extra_keys IS NOT NULL"
        ).fetchone()
        index = PrefixIndex(conn)

        def walk(last: int, lora: str | None, salt: str | None = None) -> list[tuple[str, int]]:
            holders = index.match_tokens(MODEL, 0, life.tokens(last), lora, True, HOUR, salt)
            return [(h.medium, h.matched_blocks) for h in holders]

        found = {
            "plain": walk(plain[-1], None), "lora": walk(adapted[-1], LORA),
            "lora, asked without it": walk(adapted[-1], None),
            "salted, by tokens": walk(salted[-1], None),
            "salted, with its salt": walk(salted[-1], None, "tenant-7"),
            "salted, with another": walk(salted[-1], None, "tenant-8"),
        }  # fmt: skip
        by_hash = index.match(MODEL, 0, [(h % 2**64).to_bytes(8, "big") for h in salted],
                              "block", True, HOUR)  # fmt: skip
    assert want and got == want
    assert {(m, o) for _, _, m, o in got} == {
        ("GPU", ""),
        ("CPU", ""),
        ("STORAGE", ""),
        ("STORAGE", "external"),
    }
    assert [(a, b) for a, b in ranges] == [(lost_seq := min(s for _, s in lost), lost_seq + 2)]
    assert salts == (2,)  # each salted request's first page carries its salt (two requests)
    assert found == {
        "plain": [("CPU", 3), ("GPU", 3), ("STORAGE", 2), ("STORAGE", 1)],  # disk, external
        "lora": [("GPU", 3)],
        "lora, asked without it": [],
        "salted, by tokens": [],  # a salted page is never found without its salt
        "salted, with its salt": [("GPU", 3)],
        "salted, with another": [],
    }  # fmt: skip
    assert [(h.medium, h.matched_blocks) for h in by_hash] == [("GPU", 3)]


def test_no_batch_of_sglangs_publisher_stops_the_relay(
    kafka_bootstrap: str, fresh_database: str, make_topic: Any, group_id: str, kv: ModuleType
) -> None:
    """Batches that stopped the relay for good (its successor replayed them and stopped
    again), sent by SGLang's own publisher, replayed at start and live: a NaN, infinite or
    absurd ts, a rank past the envelope's int, a medium SGLang does not have. Each is
    recorded lost; the relay goes on, and its successor resumes after them."""
    topic = make_topic("sglang-odd", partitions=3)
    life = Life(kv, buffer_steps=256)
    lost: set[tuple[int, int]] = set()

    def hostile() -> None:
        page = kv.BlockRemoved(block_hashes=[life._hash()], medium="GPU")
        for ts in (math.nan, math.inf, -math.inf, 1e16):
            lost.add((0, life.send(page, ts=ts)))
        lost.add((0, life.send(page, attn_dp_rank=2**62)))
        lost.add((0, life.send(kv.BlockRemoved(block_hashes=[1], medium="TAPE"))))

    relay = None
    try:
        life.request()
        hostile()  # before the relay listens: it meets these replaying from 0
        life.request()
        for _ in range(2):  # the second relay resumes after what the first relayed
            relay = run_relay(life, kafka_bootstrap, topic)
            hostile()
            life.request()
            relayed(relay, life)
            assert relay.alive()
            relay.stop()
    finally:
        if relay is not None:
            relay.stop()
        life.publisher.shutdown()
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    want = truth(life.sent, lost)
    assert want and residencies_of(fresh_database, SOURCE) == want
    assert sorted(lost_ranges(fresh_database, SOURCE)) == [(s, s) for _, s in sorted(lost)]
