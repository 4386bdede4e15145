"""`kvledger relay` against a real ZMQ engine speaking vLLM's protocol, a real Kafka broker and
a real PostgreSQL index: each scenario ends with the index compared against a reference built
from what the engine published."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import msgspec
import pytest

from kvledger.consumer.db import connect
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.relay import Relay
from kvledger.producer.vllm import from_vllm_fields
from kvledger.schemas.events import BlockRemoved, BlockStored
from kvledger.schemas.topics import ensure_topic
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.router.index import RouterIndex
from kvledger.vllm_engine import Event, ZmqEngine, cleared, removed, stored
from tests.helpers.consuming import consume, residencies_of
from tests.helpers.kafka import private_kafka
from tests.helpers.procs import free_port, free_ports, spawn

pytestmark = pytest.mark.integration

MODEL = "m"
GROUPS = ("0:full_attention:4", "1:full_attention:16:4")
Key = tuple[int, bytes, str, str]  # group, hash, medium, ownership


# ---------------------------------------------------------------------- the engine's work
class Workload:
    """A deterministic stream of vLLM batches: chains stored on GPU and CPU, removals of
    what is held, partial recurrent tails in group 1 (block 16, hash 4), rare clears."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.held: list[tuple[int, int, str]] = []  # (group, hash, medium)
        self.next_hash = seed * 1_000_000 + 1

    def _hash(self) -> int:
        self.next_hash += 1
        return (self.next_hash * 0x9E3779B97F4A7C15) % 2**64  # spread over 64 bits

    def batch(self) -> list[Event]:
        out = []
        for _ in range(self.rng.randint(1, 3)):
            roll = self.rng.random()
            if roll < 0.55 or not self.held:
                medium = self.rng.choice(["GPU", "CPU"])
                n = self.rng.randint(1, 4)
                hashes = [self._hash() for _ in range(n)]
                tokens = [self.rng.randrange(50_000) for _ in range(4 * n)]
                out.append(stored(hashes, None, tokens, 4, medium))
                self.held += [(0, h, medium) for h in hashes]
            elif roll < 0.65:
                hashes = [self._hash() for _ in range(3)]  # a partial tail: hash size 4
                out.append(stored(hashes, None, list(range(12)), 4, "CPU", group_idx=1))
                self.held += [(1, h, "CPU") for h in hashes]
            elif roll < 0.98:
                group, h, medium = self.held.pop(self.rng.randrange(len(self.held)))
                extra = {"group_idx": group} if group else {}
                out.append(removed([h], medium, **extra))
            else:
                out.append(cleared())
                self.held = [x for x in self.held if x[2] != "GPU"]
        return out


def reference(incarnations: Sequence[Sequence[tuple[int, float, list[Event]]]],
              lost: Callable[[int, int], bool] = lambda i, s: False) -> dict[Key, int]:  # fmt: skip
    """The source's residencies from the engine's batches: a restart ends GPU and CPU; a lost
    batch (``lost(incarnation, seq)``) ends everything and is not applied."""
    refs: Counter[Key] = Counter()
    for i, batches in enumerate(incarnations):
        if i:
            refs = Counter({k: v for k, v in refs.items() if k[2] == "STORAGE"})
        losing = False
        for seq, _, events in batches:
            if lost(i, seq):
                if not losing:
                    refs.clear()
                losing = True
                continue
            losing = False
            for e in events:
                ev = from_vllm_fields(e.kind, e.fields)
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        refs[(ev.group_idx or 0, h, ev.medium or "GPU", "")] += 1
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        key = (ev.group_idx or 0, h, ev.medium or "GPU", "")
                        refs[key] = max(0, refs[key] - 1)
                else:
                    refs = Counter({k: v for k, v in refs.items() if k[2] != "GPU"})
    return {k: v for k, v in refs.items() if v > 0}


def index_of(db: str, source: str) -> dict[Key, int]:
    return residencies_of(db, source)


def health(db: str, source: str) -> tuple[int, int, int, int]:
    with connect(db, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(duplicates), 0), coalesce(sum(lost_gaps), 0), "
            "coalesce(sum(lost_batches), 0), (SELECT count(*) FROM kvledger.rejected_events) "
            "FROM kvledger.source_health WHERE source = %s",
            (source,),
        ).fetchone()
    assert row is not None
    return tuple(int(x) for x in row)  # type: ignore[return-value]


# ---------------------------------------------------------------------- fixtures
@pytest.fixture
def topic(make_topic: Callable[..., str]) -> str:
    return make_topic("relay", partitions=3)


@pytest.fixture
def engines() -> Iterator[list[ZmqEngine]]:
    made: list[ZmqEngine] = []
    yield made
    for engine in made:
        engine.close()


def engine_pair(engines: list[ZmqEngine], **kwargs: object) -> ZmqEngine:
    """An engine rank on a free port and its replay port."""
    engine = ZmqEngine(free_port(), free_port(), **kwargs)  # type: ignore[arg-type]
    engines.append(engine)
    return engine


def relay_config(engine: ZmqEngine, bootstrap: str, topic: str, source: str,
                 **kwargs: object) -> RelayConfig:  # fmt: skip
    return RelayConfig(
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        source=source,
        model=MODEL,
        bootstrap_servers=bootstrap,
        topic=topic,
        groups=[parse_group(g, MODEL) for g in GROUPS],
        heartbeat_interval_s=1.0,
        **kwargs,  # type: ignore[arg-type]
    )


def wait_relayed(relay: Relay, engines: Sequence[ZmqEngine], timeout: float = 60) -> None:
    """Until every rank has committed its engine's last batch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r.committed_seq == e.seq - 1 for r, e in zip(relay.ranks, engines, strict=True)):
            return
        assert not relay.errors, relay.errors
        time.sleep(0.05)
    where = [(r.committed_seq, e.seq - 1) for r, e in zip(relay, engines, strict=True)]
    raise AssertionError(f"not relayed (committed, published): {where}")


def wait_committed(relay: Relay, last: int, timeout: float = 60) -> None:
    """Until the relay's rank 0 has committed engine batch ``last``."""
    deadline = time.monotonic() + timeout
    while relay.ranks[0].committed_seq != last:
        assert time.monotonic() < deadline, (relay.ranks[0].committed_seq, last)
        assert not relay.errors, relay.errors
        time.sleep(0.05)


def committed_reader(bootstrap: str, topic: str) -> Any:
    """A read_committed reader of ``topic`` from its start, committing nothing."""
    from confluent_kafka import Consumer

    reader = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"reader-{time.time_ns()}",
        "auto.offset.reset": "earliest", "isolation.level": "read_committed",
        "enable.auto.commit": False,
    })  # fmt: skip
    reader.subscribe([topic])
    return reader


def run_relay(config: RelayConfig) -> Relay:
    relay = Relay(config)
    relay.start()
    assert relay.ready(60), "the relay did not resynchronise with the engine"
    return relay


# ---------------------------------------------------------------------- scenarios
def test_two_ranks_in_both_encodings_and_nothing_lost(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    engines: list[ZmqEngine],
) -> None:  # fmt: skip
    port, replay = free_ports(2), free_ports(2)
    ranks = engines  # each closed by the fixture, even when the second fails to bind
    ranks.append(ZmqEngine(port, replay, rank=0, positional=False))
    ranks.append(ZmqEngine(port + 1, replay + 1, rank=1, positional=True))
    work = [Workload(1), Workload(2)]
    for engine, w in zip(ranks, work, strict=True):  # published before the relay listens
        for _ in range(30):
            engine.publish(w.batch())
    config = relay_config(ranks[0], kafka_bootstrap, topic, "e2", dp_size=2)
    relay = run_relay(config)
    try:
        for _ in range(200):
            for engine, w in zip(ranks, work, strict=True):
                engine.publish(w.batch())
        wait_relayed(relay, ranks)
    finally:
        relay.stop()
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    for rank, engine in enumerate(ranks):
        source = f"e2-dp{rank}"
        want = reference(engine.incarnations)
        assert want and index_of(fresh_database, source) == want
        assert health(fresh_database, source) == (0, 0, 0, 0)
    metrics = relay.metrics
    assert metrics.unrecoverable.labels("e2-dp0")._value.get() == 0


def test_a_missed_batch_is_replayed_and_an_old_gap_is_recorded_lost(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    engines: list[ZmqEngine],
) -> None:  # fmt: skip
    engine = engine_pair(engines, buffer_steps=50)
    work = Workload(3)
    relay = run_relay(relay_config(engine, kafka_bootstrap, topic, "gappy"))
    try:
        time.sleep(0.5)  # the subscription reaches the engine
        for _ in range(20):
            engine.publish(work.batch())
        for _ in range(3):
            engine.publish(work.batch(), hide=True)  # missed live, still buffered
        for _ in range(20):
            engine.publish(work.batch())
        wait_relayed(relay, [engine])
        assert relay.metrics.gaps.labels("gappy")._value.get() >= 1
        assert relay.metrics.unrecoverable.labels("gappy")._value.get() == 0
        # A gap the buffer no longer holds: ten hidden batches, then the buffer rolls on.
        first_lost = engine.seq
        for _ in range(10):
            engine.publish(work.batch(), hide=True)
        engine.forget_before(engine.seq)
        for _ in range(20):
            engine.publish(work.batch())
        wait_relayed(relay, [engine])
    finally:
        relay.stop()
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    lost = range(first_lost, first_lost + 10)
    want = reference(engine.incarnations, lambda i, s: s in lost)
    assert index_of(fresh_database, "gappy") == want
    assert health(fresh_database, "gappy") == (0, 2, 20, 0)  # in each of the two groups
    with connect(fresh_database, autocommit=True) as conn:
        ranges = conn.execute(
            "SELECT DISTINCT first_lost_seq, last_lost_seq FROM kvledger.lifecycle_events "
            "WHERE kind = 'lost'"
        ).fetchall()
    assert ranges == [(first_lost, first_lost + 9)]


def test_engine_restart_starts_a_new_epoch(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    engines: list[ZmqEngine],
) -> None:  # fmt: skip
    engine = engine_pair(engines)
    work = Workload(4)
    relay = run_relay(relay_config(engine, kafka_bootstrap, topic, "phoenix"))
    try:
        for _ in range(40):
            engine.publish(work.batch())
        engine.publish([stored([77], None, [1, 2, 3, 4], 4, "STORAGE")])  # survives
        wait_relayed(relay, [engine])
        engine.restart()
        work = Workload(5)
        for _ in range(40):
            engine.publish(work.batch())
        wait_relayed(relay, [engine])
    finally:
        relay.stop()
    assert relay.metrics.engine_restarts.labels("phoenix")._value.get() == 1
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    assert index_of(fresh_database, "phoenix") == reference(engine.incarnations)
    with connect(fresh_database, autocommit=True) as conn:
        restarts = conn.execute("SELECT restarts FROM kvledger.sources").fetchall()
    assert restarts == [(1,)]


def test_relay_killed_mid_stream_resumes_without_loss_or_duplicates(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    engines: list[ZmqEngine], tmp_path: Path,
) -> None:  # fmt: skip
    engine = engine_pair(engines)
    work = Workload(6)

    metrics_port = free_port()

    def command() -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "kvledger.cli", "relay", "--endpoint", engine.endpoint,
                "--replay-endpoint", engine.replay_endpoint, "--source", "lazarus",
                "--model", MODEL, "--bootstrap", kafka_bootstrap, "--topic", topic,
                "--metrics-port", str(metrics_port)]  # fmt: skip
        for g in GROUPS:
            args += ["--group", g]
        return spawn(args, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "relay.log", "ab"))

    proc = command()
    try:
        for _ in range(3):
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                engine.publish(work.batch())
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)  # at whatever instant it is
            proc.wait(10)
            for _ in range(50):  # published while no relay listens
                engine.publish(work.batch())
            proc = command()
        time.sleep(2)
        for _ in range(30):
            engine.publish(work.batch())
        _wait_for_index(kafka_bootstrap, fresh_database, topic, group_id, "lazarus", engine)
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        received = re.search(r'kvledger_relay_batches_received_total\{source="lazarus"\} (\S+)',
                             scrape)  # fmt: skip
        assert received and float(received.group(1)) > 0, scrape[:2000]
        assert 'kvledger_relay_unrecoverable_gaps_total{source="lazarus"} 0.0' in scrape
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    log = (tmp_path / "relay.log").read_text()
    # Once from nothing, then from the topic: a relay killed before it found its place is
    # followed by one that does.
    assert log.count("no engine history") == 1, log[-3000:]
    assert log.count("resuming epoch") >= 2, log[-3000:]
    assert index_of(fresh_database, "lazarus") == reference(engine.incarnations), log[-3000:]
    assert health(fresh_database, "lazarus") == (0, 0, 0, 0), log[-3000:]
    with connect(fresh_database, autocommit=True) as conn:
        restarts = conn.execute(
            "SELECT restarts, closed_at FROM kvledger.sources WHERE source = 'lazarus'"
        ).fetchone()
    assert restarts == (0, None)  # a relay's restart is neither a new epoch nor a goodbye


def _wait_for_index(
    bootstrap: str, db: str, topic: str, group: str, source: str, engine: ZmqEngine,
    timeout: float = 90,
) -> None:  # fmt: skip
    """Consume until the index holds the engine's last batch (the relay runs elsewhere)."""
    deadline = time.monotonic() + timeout
    want = reference(engine.incarnations)
    while time.monotonic() < deadline:
        consume(bootstrap, db, topic, group)
        if index_of(db, source) == want:
            return
        time.sleep(1)


def test_kafka_outage_pauses_the_relay_and_replay_fills_in(
    fresh_database: str, engines: list[ZmqEngine], tmp_path: Path, group_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The broker stops mid-stream and comes back: the relay never exits, and the batches
    published meanwhile reach the index (from the engine's buffer)."""
    from confluent_kafka.admin import AdminClient

    with private_kafka(tmp_path / "state") as broker:
        bootstrap = broker.bootstrap
        topic = "kv-events"
        ensure_topic(AdminClient({"bootstrap.servers": bootstrap}), topic, 3)
        # Small socket queues: batches published during the outage overflow them and are
        # dropped live, so the relay must get them back by replay.
        engine = engine_pair(engines, send_hwm=20)
        work = Workload(7)
        relay = run_relay(relay_config(engine, bootstrap, topic, "patient", receive_hwm=20))
        try:
            for _ in range(50):
                engine.publish(work.batch())
            wait_relayed(relay, [engine])
            broker.stop()
            with caplog.at_level(logging.INFO):
                for _ in range(5000):  # more than the sockets and TCP buffers hold
                    engine.publish(work.batch())
                time.sleep(3)
                assert relay.alive()
                paused = relay.metrics.kafka_paused.labels("patient")
                deadline = time.monotonic() + 15  # within a commit try or two
                while paused._value.get() != 1 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert paused._value.get() == 1  # the metric says what the relay does
            broker.start()
            for _ in range(20):
                engine.publish(work.batch())
            wait_relayed(relay, [engine], timeout=180)
        finally:
            relay.stop()
        assert relay.metrics.unrecoverable.labels("patient")._value.get() == 0
        assert relay.metrics.gaps.labels("patient")._value.get() >= 1  # dropped live
        assert relay.metrics.kafka_paused.labels("patient")._value.get() == 0
        # Messages an aborted transaction dropped are re-sent, not "failed": no such line.
        failed = [r for r in caplog.records if "delivery failed" in r.getMessage()]
        assert failed == [], failed[:3]
        consume(bootstrap, fresh_database, topic, group_id, batch=50)
        assert index_of(fresh_database, "patient") == reference(engine.incarnations)
        assert health(fresh_database, "patient") == (0, 0, 0, 0)


# ---------------------------------------------------------------------- vLLM's own publisher
@pytest.mark.parametrize("vllm_kv_events", ["0.33.0", "0.34.0"], indirect=True)
def test_vllms_own_publisher_feeds_the_index(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    vllm_kv_events: ModuleType,
) -> None:  # fmt: skip
    kv = vllm_kv_events
    port, replay = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
    )
    work = Workload(8)
    sent: list[tuple[int, float, list[Event]]] = []

    def publish(count: int) -> None:
        for _ in range(count):
            events = work.batch()
            ts = time.time()
            batch = kv.KVEventBatch(ts=ts, events=[getattr(kv, e.kind)(**e.fields) for e in events])
            publisher.publish(batch)
            sent.append((len(sent), ts, events))

    chain = [2**64 - 3, 2**64 - 2, 2**64 - 1]  # a prompt's first blocks, held on GPU
    lora_chain = [2**64 - 13, 2**64 - 12, 2**64 - 11]  # and a LoRA prompt's
    salted_chain = [2**64 - 23, 2**64 - 22, 2**64 - 21]  # and a salted prompt's

    try:
        publish(40)  # before the relay listens: it starts by replaying from 0
        config = RelayConfig(
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay}",
            source="stock",
            model=MODEL,
            bootstrap_servers=kafka_bootstrap,
            topic=topic,
            groups=[parse_group(g, MODEL) for g in GROUPS],
        )
        relay = run_relay(config)
        try:
            publish(300)
            chain_event = stored(chain, None, list(range(12)), 4, "GPU")
            # A LoRA request's blocks, as vLLM 0.33.0 sends them: the adapter's name first in
            # every block's extra keys, and as lora_name.
            lora_event = stored(
                lora_chain, None, list(range(500, 512)), 4, "GPU", lora_id=7,
                lora_name="adapter-a", extra_keys=[("adapter-a",)] * 3,
            )  # fmt: skip
            # A salted request's: the salt is the first block's only extra key.
            salted_event = stored(
                salted_chain, None, list(range(500, 512)), 4, "GPU",
                extra_keys=[("tenant-9",), None, None],
            )  # fmt: skip
            events = (chain_event, lora_event, salted_event)
            batch = kv.KVEventBatch(
                ts=time.time(), events=[kv.BlockStored(**e.fields) for e in events]
            )
            publisher.publish(batch)
            sent.append((len(sent), batch.ts, list(events)))
            wait_committed(relay, len(sent) - 1)
        finally:
            relay.stop()
    finally:
        publisher.shutdown()
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    want = reference([sent])
    assert want and index_of(fresh_database, "stock") == want
    assert health(fresh_database, "stock") == (0, 0, 0, 0)  # partial tails fit their spec
    with connect(fresh_database, autocommit=True) as conn:
        partial, known = conn.execute(
            "SELECT count(*) FILTER (WHERE partial), count(*) FILTER (WHERE token_start = 0) "
            "FROM kvledger.blocks"
        ).fetchone()  # type: ignore[misc]
    assert partial > 0 and known > 0  # vLLM's tails are partial; roots start at 0
    # Positions come from the chain, so a prefix match counts tokens (and tiers can weigh).
    with connect(fresh_database, autocommit=True) as conn:
        holders = PrefixIndex(conn).match(
            MODEL, 0, [h.to_bytes(8, "big") for h in chain], silent_after=timedelta(hours=1)
        )
    assert [(h.instance, h.medium, h.matched_blocks, h.matched_tokens) for h in holders] == [
        ("stock", "GPU", 3, 12)
    ]
    # The LoRA prompt is found by its tokens under its adapter, and only under it.
    with connect(fresh_database, autocommit=True) as conn:
        index = PrefixIndex(conn)
        hour = timedelta(hours=1)
        lora = index.match_tokens(MODEL, 0, range(500, 512), "adapter-a", silent_after=hour)
        base = index.match_tokens(MODEL, 0, range(500, 512), silent_after=hour)
        salted = index.match_tokens(
            MODEL, 0, range(500, 512), silent_after=hour, cache_salt="tenant-9"
        )
        other_salt = index.match_tokens(
            MODEL, 0, range(500, 512), silent_after=hour, cache_salt="tenant-8"
        )
        router = RouterIndex(kafka_bootstrap, topic, group_id)
        router.bootstrap(conn)
        (kept,) = conn.execute(
            "SELECT array_agg(DISTINCT lora_name) FROM kvledger.blocks WHERE block_hash = ANY(%s)",
            ([h.to_bytes(8, "big") for h in lora_chain],),
        ).fetchone()  # type: ignore[misc]
    assert [(h.instance, h.matched_blocks, h.matched_tokens) for h in lora] == [("stock", 3, 12)]
    assert base == [] and kept == ["adapter-a"]  # the same tokens, unsalted, without LoRA
    # The salted prompt: found by its tokens given its salt, from SQL and from memory.
    assert [(h.instance, h.matched_blocks) for h in salted] == [("stock", 3)]
    assert other_salt == []
    from_memory = router.match_tokens(
        MODEL, 0, range(500, 512), silent_after=hour, cache_salt="tenant-9"
    )
    assert [(h.instance, h.matched_blocks) for h in from_memory] == [("stock", 3)]
    assert router.match_tokens(MODEL, 0, range(500, 512), silent_after=hour) == []


def deep_extra_keys(depth: int) -> msgspec.Raw:
    """An extra key nested ``depth`` arrays deep, as bytes (no encoder writes that deep)."""
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


def test_no_batch_of_vllms_publisher_stops_the_relay(
    kafka_bootstrap: str, fresh_database: str, make_topic: Callable[..., str], group_id: str,
    vllm_kv_events: ModuleType,
) -> None:  # fmt: skip
    """Batches that stopped the relay for good (the restarted relay replayed them and stopped
    again), sent by vLLM's own publisher, replayed at start and live: a NaN, infinite or
    absurd ts; a data-parallel rank past the envelope's int; extra keys nested 100,000 deep;
    a store larger than the topic takes. Each such batch is recorded lost, except the large
    store, which travels as several chained stores; a single block too large for a message is
    recorded lost. The relay never stops, and its successor resumes after them."""
    kv = vllm_kv_events
    topic = make_topic("hostile-relay", partitions=3, **{"max.message.bytes": "60000"})
    port, replay = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
    )
    work = Workload(11)
    sent: list[tuple[int, float, list[Event]]] = []
    lost: set[int] = set()
    rng = random.Random(5)
    next_hash = iter(range(2**62, 2**63))
    long_hashes: list[bytes] = []

    def publish(events: list[Event], ts: float | None = None, rank: int = 0,
                raw_extra: msgspec.Raw | None = None) -> int:  # fmt: skip
        vllm_events = [getattr(kv, e.kind)(**e.fields) for e in events]
        if raw_extra is not None:
            vllm_events[0].extra_keys = [raw_extra]
        now = time.time() if ts is None else ts
        publisher.publish(kv.KVEventBatch(ts=now, events=vllm_events, data_parallel_rank=rank))
        sent.append((len(sent), now, events))
        return len(sent) - 1

    def normal(count: int) -> None:
        for _ in range(count):
            publish(work.batch())

    def long_prompt(blocks: int) -> Event:  # ~3 bytes a token: several messages' worth
        hashes = [next(next_hash) for _ in range(blocks)]
        long_hashes.extend(h.to_bytes(8, "big") for h in hashes)
        return stored(hashes, None, [rng.randrange(50_000) for _ in range(4 * blocks)], 4, "GPU")

    def hostile() -> None:
        one = [stored([next(next_hash)], None, [1, 2, 3, 4], 4, "GPU")]
        for ts in (math.nan, math.inf, -math.inf, 1e16):
            lost.add(publish(one, ts=ts))
        lost.add(publish(one, rank=2**62))
        lost.add(publish(one, raw_extra=deep_extra_keys(100_000)))
        # One block whose tokens alone are more than a message takes.
        big = stored([next(next_hash)], None, [40_000 + i for i in range(30_000)], 4, "GPU")
        lost.add(publish([big]))
        publish([long_prompt(6_000)])  # split, not lost

    relay = None
    try:
        normal(20)
        hostile()  # before the relay listens: it meets these replaying from 0
        normal(20)
        config = RelayConfig(
            endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
            source="stock", model=MODEL, bootstrap_servers=kafka_bootstrap, topic=topic,
            groups=[parse_group(g, MODEL) for g in GROUPS],
        )  # fmt: skip
        for _ in range(2):  # the second relay resumes after everything the first relayed
            relay = run_relay(config)
            time.sleep(0.3)
            hostile()
            normal(20)
            deadline = time.monotonic() + 60
            while relay.ranks[0].committed_seq != len(sent) - 1:
                assert time.monotonic() < deadline, (relay.ranks[0].committed_seq, len(sent))
                assert not relay.errors and relay.alive(), relay.errors
                time.sleep(0.05)
            relay.stop()
            assert not relay.errors
    finally:
        if relay is not None:
            relay.stop()
        publisher.shutdown()
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    want = reference([sent], lambda i, s: s in lost)
    assert index_of(fresh_database, "stock") == want
    with connect(fresh_database, autocommit=True) as conn:
        ranges = conn.execute(
            "SELECT DISTINCT first_lost_seq, last_lost_seq FROM kvledger.lifecycle_events "
            "WHERE kind = 'lost' ORDER BY 1"
        ).fetchall()
        (whole,) = conn.execute(
            "SELECT count(DISTINCT block_hash) FROM kvledger.blocks WHERE block_hash = ANY(%s)",
            (long_hashes,),
        ).fetchone()  # type: ignore[misc]
    assert ranges == [(s, s) for s in sorted(lost)]
    assert whole == len(long_hashes) == 3 * 6_000  # the long prompts, every block


def test_what_cannot_be_recovered_is_recorded_lost(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    engines: list[ZmqEngine],
) -> None:  # fmt: skip
    """A batch that does not decode (not msgpack; an int beyond the contract's range), and a
    missed batch with no replay socket to ask: each is published as EventsLost for its exact
    range (the index clears the source's groups), and relaying goes on; messages not in the
    protocol's shape are skipped."""
    engine = engine_pair(engines)
    work = Workload(9)
    config = dataclasses.replace(
        relay_config(engine, kafka_bootstrap, topic, "blind"), replay_endpoint=None
    )
    relay = run_relay(config)
    try:
        time.sleep(0.5)
        for _ in range(10):
            engine.publish(work.batch())
        engine.pub.send_multipart([engine.topic, b"two frames"])  # not the protocol:
        engine.pub.send_multipart([engine.topic, b"\x01", b"x"])  # skipped, the relay goes on
        garbage = engine.publish_payload(b"\x93not msgpack at all")
        huge = engine.publish_payload(msgspec.msgpack.encode([time.time(), [
            {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": 2**40},
        ]]))  # fmt: skip
        for _ in range(10):
            engine.publish(work.batch())
        hidden = engine.publish(work.batch(), hide=True)  # no replay socket: lost
        for _ in range(10):
            engine.publish(work.batch())
        wait_relayed(relay, [engine])
    finally:
        relay.stop()
    metrics = relay.metrics
    assert metrics.undecodable.labels("blind")._value.get() == 2
    assert metrics.unrecoverable.labels("blind")._value.get() == 3
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    lost = {garbage, huge, hidden}
    batches = sorted([*engine.published, (garbage, 0.0, []), (huge, 0.0, [])])  # nothing kept
    assert index_of(fresh_database, "blind") == reference([batches], lambda i, s: s in lost)
    with connect(fresh_database, autocommit=True) as conn:
        ranges = conn.execute(
            "SELECT DISTINCT first_lost_seq, last_lost_seq FROM kvledger.lifecycle_events "
            "WHERE kind = 'lost' ORDER BY 1"
        ).fetchall()
    assert ranges == [(garbage, garbage), (huge, huge), (hidden, hidden)]


def test_the_kafka_settings_reach_every_client(
    kafka_bootstrap: str, fresh_database: str, topic: str, tmp_path: Path
) -> None:
    """A setting the Kafka client refuses, given once in a properties file, stops `consume`
    and `relay` at once with the client's own words (it reached them), in one line."""
    props = tmp_path / "client.properties"
    props.write_text("no.such.property=1\n")
    for command in (
        ["consume", "--database-url", fresh_database, "--until-caught-up", "--topic", topic],
        ["relay", "--endpoint", "tcp://127.0.0.1:1", "--source", "s", "--model", MODEL,
         "--topic", topic],
    ):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "kvledger", *command, "--bootstrap", kafka_bootstrap,
             "--kafka-config", str(props)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 1, (command[0], done.stderr[-2000:])
        assert "No such configuration property" in done.stderr, done.stderr[-2000:]


def test_a_relay_says_its_engine_is_there_as_it_starts(
    kafka_bootstrap: str, topic: str, engines: list[ZmqEngine]
) -> None:
    """A relay restarted after the index's liveness window left its live engine silent
    until its first heartbeat interval passed (the lab's relay restart: the engine dropped
    from answers). It heartbeats once resynchronised."""

    from kvledger.schemas.codec import Codec
    from kvledger.schemas.events import Heartbeat

    engine = engine_pair(engines)
    config = dataclasses.replace(
        relay_config(engine, kafka_bootstrap, topic, "prompt"), heartbeat_interval_s=600.0
    )
    relay = run_relay(config)
    try:
        reader = committed_reader(kafka_bootstrap, topic)
        codec, beats = Codec(), 0
        deadline = time.monotonic() + 20
        while not beats and time.monotonic() < deadline:
            msg = reader.poll(0.5)
            if msg is not None and msg.error() is None:
                beats += isinstance(codec.decode(msg.value()).event, Heartbeat)
        reader.close()
    finally:
        relay.stop()
    assert beats == 1  # long before the 600 s interval


def test_a_relay_with_a_health_url_is_silent_until_the_engine_serves(
    kafka_bootstrap: str, topic: str, engines: list[ZmqEngine]
) -> None:
    """An engine's replay socket answers seconds before its HTTP server: a relay that took
    that as the engine being there made a starting engine live to routers that could not
    reach it yet (the lab's requests sent to a restarting engine). With ``health_url`` the
    relay says nothing (no resync, no heartbeat) until the route answers 200, and an idle
    probe while it does not is skipped."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvledger.schemas.codec import Codec

    status = {"code": 503}

    class Health(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(status["code"])
            self.send_header("content-length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = engine_pair(engines)
    config = dataclasses.replace(
        relay_config(engine, kafka_bootstrap, topic, "starting"), heartbeat_interval_s=0.3,
        health_url=f"http://127.0.0.1:{server.server_port}/health",
    )  # fmt: skip
    relay = Relay(config)
    reader = committed_reader(kafka_bootstrap, topic)
    codec = Codec()

    def kinds_for(seconds: float) -> list[str]:
        out, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = reader.poll(0.2)
            if msg is not None and msg.error() is None:
                out.append(type(codec.decode(msg.value()).event).__name__)
        return out

    def unhealthy() -> float:
        return relay.metrics.unhealthy.labels("starting")._value.get()

    relay.start()
    try:
        assert kinds_for(2.5) == []  # the replay socket answers; the engine is not serving
        assert not relay.ready(0) and unhealthy() >= 2
        status["code"] = 200
        assert relay.ready(30)
        assert "Heartbeat" in kinds_for(2.0)  # there once it serves, and while it is
        status["code"] = 503  # its HTTP server goes (the engine is stopping)
        time.sleep(0.5)  # a heartbeat already on its way
        kinds_for(0.5)
        before = unhealthy()
        assert kinds_for(2.0) == []  # idle probes skipped: silence
        assert unhealthy() > before
        status["code"] = 200
        assert "Heartbeat" in kinds_for(2.0)
    finally:
        relay.stop()
        reader.close()
        server.shutdown()
        server.server_close()


def test_a_hybrid_engines_state_checkpoints_reach_the_index(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    vllm_kv_events: ModuleType,
) -> None:  # fmt: skip
    """vLLM 0.34 (whose kv_events module is 0.33.0's, byte for byte) announces a recurrent
    group's offloaded chunk as a state checkpoint: one hash, its parent, the block size, no
    tokens. Sent by vLLM's own publisher through the relay, each is indexed in its group
    with its holder and history (partial tails too); one that cannot be a checkpoint is
    dead-lettered saying why."""
    kv = vllm_kv_events
    port, replay = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
    )
    attention = kv.BlockStored(
        block_hashes=[11, 12, 13, 14], parent_block_hash=None, token_ids=list(range(16)),
        block_size=4, lora_id=None, medium="CPU", lora_name=None, group_idx=0,
        kv_cache_spec_kind="full_attention",
    )  # fmt: skip

    def state(at: int, parent: int, size: int, hashes: int = 1, group: int = 2) -> Any:
        return kv.BlockStored(
            block_hashes=[at + i for i in range(hashes)], parent_block_hash=parent,
            token_ids=[], block_size=size, lora_id=None, medium="CPU", lora_name=None,
            group_idx=group, kv_cache_spec_kind="mamba" if group == 2 else "full_attention",
        )  # fmt: skip

    batches = [
        [attention, state(12, 11, 8), state(14, 13, 8)],
        [state(13, 12, 4)],  # a partial tail's state (the hash size)
        [kv.BlockRemoved(block_hashes=[12], medium="CPU", group_idx=2)],
        [state(15, 14, 8, hashes=2)],  # two hashes: not a checkpoint
        [state(16, 14, 4, group=0)],  # no tokens in an attention group
    ]
    try:
        config = RelayConfig(
            endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
            source="hybrid", model=MODEL, bootstrap_servers=kafka_bootstrap, topic=topic,
            groups=[parse_group(g, MODEL) for g in (*GROUPS, "2:mamba:8:4")],
        )  # fmt: skip
        for events in batches:  # before the relay listens: replayed at its start
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        relay = run_relay(config)
        try:
            wait_committed(relay, len(batches) - 1)
        finally:
            relay.stop()
    finally:
        publisher.shutdown()
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    with connect(fresh_database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT block_hash, parent_hash, block_size, partial, cardinality(token_ids) "
            "FROM kvledger.blocks WHERE group_idx = 2 ORDER BY block_hash"
        ).fetchall()
        held = conn.execute(
            "SELECT block_hash FROM kvledger.residencies WHERE group_idx = 2 ORDER BY 1"
        ).fetchall()
        ended = conn.execute(
            "SELECT block_hash, removed_by FROM kvledger.residency_history "
            "WHERE group_idx = 2 AND removed_at IS NOT NULL"
        ).fetchall()
        rejected = conn.execute(
            "SELECT reason, detail FROM kvledger.rejected_events ORDER BY detail"
        ).fetchall()
    b = lambda i: i.to_bytes(8, "big")  # noqa: E731
    assert [(bytes(r[0]), bytes(r[1]), r[2], r[3], r[4]) for r in rows] == [
        (b(12), b(11), 8, False, 0), (b(13), b(12), 4, True, 0), (b(14), b(13), 8, False, 0),
    ]  # fmt: skip
    assert [bytes(r[0]) for r in held] == [b(13), b(14)]
    assert [(bytes(h), how) for h, how in ended] == [(b(12), "removed")]
    assert [reason for reason, _ in rejected] == ["invalid_event", "token_count_mismatch"]
    assert "names one hash" in rejected[0][1] and "recurrent group" in rejected[1][1]


def test_a_dripping_health_route_never_stalls_the_relay(
    kafka_bootstrap: str, topic: str, engines: list[ZmqEngine]
) -> None:
    """A health server that sends its answer a byte every 0.8 s held the relay's loop (the
    1 s timeout bounded each read, not the request): no Kafka message for 25 s. The route
    is now asked off the loop under a deadline for the whole request: the engine's batches
    keep flowing while it drips, and the relay heartbeats again once it answers well."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    drip = threading.Event()

    class Health(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if drip.is_set():
                for byte in b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n":
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.8)
                return
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = engine_pair(engines)
    config = dataclasses.replace(
        relay_config(engine, kafka_bootstrap, topic, "dripped"),
        heartbeat_interval_s=0.3,
        health_url=f"http://127.0.0.1:{server.server_port}/health",
    )
    relay = run_relay(config)
    work = Workload(21)
    try:
        drip.set()
        time.sleep(2.0)  # idle probes meet the drip
        for _ in range(5):
            engine.publish(work.batch())
            time.sleep(0.3)
        began = time.monotonic()
        wait_relayed(relay, [engine], timeout=5)
        assert time.monotonic() - began < 5
        assert relay.metrics.unhealthy.labels("dripped")._value.get() > 0
        drip.clear()
        engine.publish(work.batch())
        wait_relayed(relay, [engine], timeout=5)
    finally:
        relay.stop()
        server.shutdown()
