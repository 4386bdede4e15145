"""The relay and the vLLM publish path, each beside its baseline in the same run.

Each side runs ROUNDS times, alternating with its baseline; each side's best round is
reported (this 2-core machine is noisy), with the worst and best ratio of a round's pair.

1. Relay: one engine (a child process speaking vLLM's ZMQ protocol) publishes a stream of
   batches as fast as it can; a raw ZMQ SUB receives the same stream (baseline), then the
   relay carries it into Kafka (decode, map, Avro, transactional produce, committed); both
   receive an engine message the same way (``receive_message``). Block
   events per second and the ratio relay / raw receive (20,000 batches: the relay's
   fixed end, an idle poll and a commit, is ~60 ms of it). Target: >= 20,000 block events/s and
   >= 0.5 of the raw receive. Beside them, the ceiling Kafka itself sets: the relay's own
   messages, read back from its topic, produced raw (no ZMQ, no decoding, no Avro) with the
   publisher's settings by a producer started before the clock, as the relay's is; no relay
   can go faster than that.
2. Publish path shared with embedded engines: vLLM's KVEventBatch objects (its msgspec
   structs, as its engine hands them to a publisher) in ->
   ``publish_vllm_batch`` -> Avro -> Kafka, acknowledged, beside a raw produce of the same
   bytes with the same settings (no simulator in the loop; both producers started before
   the clock; the bytes recorded in an untimed round before the rounds), and the cost per
   event on the caller's thread (an engine pays it on its scheduler thread), wall and CPU;
   30,000 batches (60,000 messages). Target: >= 0.5 of raw.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import time
import uuid
from typing import Any

import zmq
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from bench.common import PUBLISHED, capture_produced, publish, raw_produce, record
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.engine import receive_message
from kvledger.producer.relay.relay import Relay
from kvledger.schemas.topics import ensure_topic
from kvledger.vllm_engine import Event, ZmqEngine, removed, stored, vllm_batch

MODEL = "bench-model"
BLOCK = 16
HASHES_PER_STORE = 16


def workload(batches: int, seed: int = 5) -> list[list[Event]]:
    """A GPU block pool's steps: each stores a request's 16 new blocks and frees 16 older."""
    rng = random.Random(seed)
    live: list[int] = []
    out = []
    for _ in range(batches):
        hashes = [rng.getrandbits(64) for _ in range(HASHES_PER_STORE)]
        tokens = [rng.randrange(50_000) for _ in range(BLOCK * HASHES_PER_STORE)]
        events = [stored(hashes, None, tokens, BLOCK, "GPU")]
        live += hashes
        if len(live) > 4 * HASHES_PER_STORE:
            events.append(removed(live[:HASHES_PER_STORE], "GPU"))
            del live[:HASHES_PER_STORE]
        out.append(events)
    return out


def block_events(batches: list[list[Event]]) -> int:
    return sum(len(e.fields["block_hashes"]) for events in batches for e in events)


def _engine(ports: Any, go: Any, done: Any, batches: int) -> None:
    """The child: make the workload, bind (its ports say it is ready), wait for the go,
    publish every batch as fast as it can, then keep answering replays until told to stop."""
    work = workload(batches)
    gc.freeze()  # the workload is not the engine's work: no collection rescans it
    engine = ZmqEngine(0, 0)
    ports.put((engine.port, engine.replay_port))  # ready: the clock may start at the go
    go.wait()
    for events in work:
        engine.publish(events)
    done.wait()
    engine.close()


class _EngineProcess:
    def __init__(self, batches: int) -> None:
        ctx = mp.get_context("spawn")
        self.ports: Any = ctx.Queue()
        self.go, self.done = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_engine, args=(self.ports, self.go, self.done, batches))
        self.proc.start()
        self.port, self.replay_port = self.ports.get(timeout=60)

    def stop(self) -> None:
        self.done.set()
        self.proc.join(30)


ROUNDS = 3  # alternating rounds of each side; each side's best is reported (a noisy machine)


def _raw_receive(batches: int) -> float:
    """Seconds for a raw SUB to receive the whole stream from a fresh engine."""
    engine = _EngineProcess(batches)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{engine.port}")
    time.sleep(1.0)  # the subscription reaches the engine
    start = time.perf_counter()
    engine.go.set()
    for _ in range(batches):
        receive_message(sub)  # as the relay receives
    seconds = time.perf_counter() - start
    sub.close(0)
    ctx.term()
    engine.stop()
    return seconds


def _relayed(bootstrap: str, topic: str, batches: int) -> tuple[float, float]:
    """Seconds for a relay to carry the stream of a fresh engine into ``topic``, committed
    (decode, Avro, transactional produce), and the gaps it replayed on the way."""
    engine = _EngineProcess(batches)
    relay = Relay(
        RelayConfig(
            endpoint=f"tcp://127.0.0.1:{engine.port}",
            replay_endpoint=f"tcp://127.0.0.1:{engine.replay_port}",
            source="bench-engine",
            model=MODEL,
            bootstrap_servers=bootstrap,
            topic=topic,
            groups=[parse_group(f"0:full_attention:{BLOCK}", MODEL)],
        )
    )
    relay.start()
    assert relay.ready(60)
    time.sleep(1.0)
    rank = relay.ranks[0]
    start = time.perf_counter()
    engine.go.set()
    while rank.committed_seq != batches - 1:
        assert not relay.errors, relay.errors
        time.sleep(0.005)
    seconds = time.perf_counter() - start
    gaps = relay.metrics.gaps.labels("bench-engine")._value.get()
    relay.stop()
    engine.stop()
    return seconds, gaps


def relay_vs_raw(bootstrap: str, batches: int = 20_000) -> dict[str, float]:
    events = block_events(workload(batches))
    admin = AdminClient({"bootstrap.servers": bootstrap})
    raw_s, relay_s, topics, gaps = [], [], [], 0.0
    for _ in range(ROUNDS):
        raw_s.append(_raw_receive(batches))
        topics.append(f"bench-relay-{uuid.uuid4().hex[:8]}")
        ensure_topic(admin, topics[-1], 12)
        seconds, round_gaps = _relayed(bootstrap, topics[-1], batches)
        relay_s.append(seconds)
        gaps += round_gaps
    # The ceiling: the relay's own messages (its last round's), produced raw.
    produced = _read_back(bootstrap, topics[-1])
    ceiling_topic = f"{topics[-1]}-raw"
    ensure_topic(admin, ceiling_topic, 12)
    ceiling_s = raw_produce(bootstrap, ceiling_topic, produced, warm=True)
    admin.delete_topics([*topics, ceiling_topic])
    raw_rate, relay_rate = events / min(raw_s), events / min(relay_s)
    ceiling = events / ceiling_s
    return {
        "batches": float(batches),
        "block events": float(events),
        "raw ZMQ receive block events/s": raw_rate,
        "relay block events/s (committed in Kafka)": relay_rate,
        "ratio relay / raw receive": relay_rate / raw_rate,
        "  each round's ratio, worst": min(r / s for r, s in zip(raw_s, relay_s, strict=True)),
        "  each round's ratio, best": max(r / s for r, s in zip(raw_s, relay_s, strict=True)),
        "gaps replayed during the runs": gaps,
        "Kafka ceiling: relay's messages produced raw, block events/s": ceiling,
        "  ceiling / raw receive (the best any relay could reach)": ceiling / raw_rate,
        "  ratio relay / ceiling": relay_rate / ceiling,
    }


def _read_back(bootstrap: str, topic: str) -> list[tuple[bytes, bytes]]:
    """Every committed message of ``topic`` as (key, value)."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "enable.partition.eof": True,
    })  # fmt: skip
    partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    out: list[tuple[bytes, bytes]] = []
    ended: set[int] = set()
    while len(ended) < len(partitions):
        for msg in consumer.consume(1000, timeout=1.0):
            err = msg.error()
            if err is not None and err.code() == KafkaError._PARTITION_EOF:
                ended.add(msg.partition() or 0)
            elif err is not None:
                raise RuntimeError(f"reading {topic} back: {err}")
            else:
                out.append((msg.key() or b"", msg.value() or b""))
    consumer.close()
    return out


UNSATURATED = 500  # the handoff holds 1,024 batches


def _embedded(bootstrap: str, topic: str, **settings: Any) -> KVEventPublisher:
    """An embedded engine's publisher (``settings``: more of its config) with its group
    announced and delivered."""
    config = PublisherConfig(
        bootstrap, "bench-embedded", MODEL, topic, heartbeat_interval_s=0, **settings
    )
    publisher = KVEventPublisher(config)
    publisher.announce_group_spec(parse_group(f"0:full_attention:{BLOCK}", MODEL))
    publisher.flush(30)
    return publisher


def publish_path(bootstrap: str, batches: int = 30_000) -> dict[str, float]:
    work = workload(batches, seed=9)
    objects = [vllm_batch(1_764_000_000.0 + i, events) for i, events in enumerate(work)]
    events = block_events(work)
    gc.freeze()  # the workload is neither side's work: no collection rescans it
    admin = AdminClient({"bootstrap.servers": bootstrap})
    full_s, raw_s, caller, caller_first, caller_cpu, topics = [], [], [], [], [], []
    # The bytes the raw side sends: one untimed round's messages, recorded as produced
    # (recording in a timed round would put the recorder's call on the vLLM path's clock).
    captured: list[tuple[bytes, bytes]] = []
    for round_ in range(-1, ROUNDS):
        run = uuid.uuid4().hex[:8]
        full_topic, raw_topic = f"bench-vllm-{run}", f"bench-vllm-raw-{run}"
        for topic in (full_topic, raw_topic) if round_ >= 0 else (full_topic,):
            topics.append(topic)  # both before either side's clock starts
            ensure_topic(admin, topic, 12)
        publisher = _embedded(bootstrap, full_topic)
        if round_ < 0:
            capture_produced(publisher, captured)
        in_calls, first_calls = 0.0, 0.0
        start, cpu = time.perf_counter(), time.thread_time()
        for i, batch in enumerate(objects):
            t = time.perf_counter()
            publisher.publish_vllm_batch(batch)
            took = time.perf_counter() - t
            in_calls += took
            if i < UNSATURATED:
                first_calls += took
        spent_cpu = time.thread_time() - cpu
        publisher.close(120, goodbye=False)
        spent = time.perf_counter() - start
        if round_ < 0:
            continue
        full_s.append(spent)
        caller.append(in_calls)
        caller_first.append(first_calls)
        caller_cpu.append(spent_cpu)
        raw_s.append(raw_produce(bootstrap, raw_topic, captured, warm=True))
    # The baseline of the caller's cost: the same batches written on the caller's thread
    # (handoff_batches=0, the publisher before the writer thread), in the same run.
    sync_topic = f"bench-vllm-sync-{uuid.uuid4().hex[:8]}"
    topics.append(sync_topic)
    ensure_topic(admin, sync_topic, 12)
    publisher = _embedded(bootstrap, sync_topic, handoff_batches=0)
    sync_calls, sync_cpu = 0.0, time.thread_time()
    for batch in objects:
        t = time.perf_counter()
        publisher.publish_vllm_batch(batch)
        sync_calls += time.perf_counter() - t
    sync_cpu = time.thread_time() - sync_cpu
    publisher.close(120, goodbye=False)
    # The vLLM plugin's call (kvledger/producer/vllm_plugin.py): numbered, the queue's wait
    # bounded (1 ms, its default), on a queue with room; the best of as many rounds.
    bounded_runs = []
    for _ in range(ROUNDS):
        bounded_topic = f"bench-vllm-bounded-{uuid.uuid4().hex[:8]}"
        topics.append(bounded_topic)
        ensure_topic(admin, bounded_topic, 12)
        publisher = _embedded(bootstrap, bounded_topic)
        spent_bounded = 0.0
        for i, batch in enumerate(objects[:UNSATURATED]):
            t = time.perf_counter()
            publisher.publish_vllm_batch(batch, engine_seq=i, wait_s=0.001)
            spent_bounded += time.perf_counter() - t
        publisher.close(120, goodbye=False)
        bounded_runs.append(spent_bounded)
    bounded = min(bounded_runs)
    messages = len(captured)
    admin.delete_topics(topics)
    return {
        # The engine's thread: the first batches of a round meet a queue with room (an
        # engine's pace); past them the writer cannot keep up with a caller that does
        # nothing else, and the queue blocks the caller (as it must: nothing is dropped).
        f"caller-thread µs per batch, queue not full (first {UNSATURATED})": min(caller_first)
        / UNSATURATED
        * 1e6,
        f"  the vLLM plugin's call (a bounded wait), first {UNSATURATED}": bounded
        / UNSATURATED
        * 1e6,
        "caller-thread CPU µs per batch (handed to the writer thread)": min(caller_cpu)
        / len(objects)
        * 1e6,
        "caller-thread µs per batch, all (a full queue blocks)": min(caller) / len(objects) * 1e6,
        "  written on the caller's thread: µs per batch": sync_calls / len(objects) * 1e6,
        "  written on the caller's thread: CPU µs per batch": sync_cpu / len(objects) * 1e6,
        "messages": float(messages),
        "block events": float(events),
        "publish_vllm_batch msg/s (acked)": messages / min(full_s),
        "raw produce msg/s (same bytes)": messages / min(raw_s),
        "ratio vLLM path / raw": min(raw_s) / min(full_s),
        "  each round's ratio, worst": min(r / f for r, f in zip(raw_s, full_s, strict=True)),
        "  each round's ratio, best": max(r / f for r, f in zip(raw_s, full_s, strict=True)),
        "caller-thread µs per message": min(caller) / messages * 1e6,
        "caller-thread µs per block event": min(caller) / events * 1e6,
        "  of which CPU, µs per message": min(caller_cpu) / messages * 1e6,
    }


def main() -> dict[str, float]:
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    figures = relay_vs_raw(bootstrap)
    record("relay", figures)
    path = publish_path(bootstrap)
    record("vllm_publish", path)
    return {**figures, **path}


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--publish-path"]:  # the embedded engine's path alone (and its files)
        figures = publish_path(os.environ["KVLEDGER_KAFKA_BOOTSTRAP"])
        written = publish({"vllm_publish": figures}, PUBLISHED / "vllm-publish",
                          command="python -m bench.relay --publish-path")  # fmt: skip
        print(f"wrote {', '.join(str(w) for w in written)}")
    else:
        main()
