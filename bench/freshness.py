"""How fresh kvledger's answers are: an engine's batch, from vLLM's own publisher (its
wheel's ZmqEventPublisher), to the moment each reader has it, per stage, beside a raw ZMQ
subscriber of the same engine in the same run.

One engine publishes one batch at a time (a request's new blocks), ``--gap-ms`` apart, with
`kvledger relay` (a child process, as deployed) carrying it into Kafka. Stages, each timed
from the publish:

- ``zmq``: a raw SUB socket on the engine receives it (the baseline: what a router fed by
  the engine's stream sees);
- ``kafka``: a read_committed consumer of the topic reads it (relay, its transaction
  committed, the broker);
- ``router``: the in-memory router index (`serve --memory`'s, Dynamo's /query's) answers a
  lookup of its blocks with the engine as their holder;
- ``republish``: a raw SUB socket on `kvledger republish`'s PUB for the engine (the same
  router index, republishing what it applied) receives it: what a router fed by kvledger
  instead of the engine sees.
- ``decision``: not an engine's batch but a router's decision (POST /v1/decisions), timed
  from one replica of the lookup service writing it to the decisions topic to another
  replica answering the prompt's holder as provisional (`serve --decisions-topic`).

p50/p99 of each. Targets: router p50 ≤ 20 ms, p99 ≤ 50 ms (the freshness issue);
republish p50 ≤ 20 ms, p99 ≤ 100 ms at 1,000 block events/s (the republish issue: the
default ``--blocks`` 40 every ``--gap-ms`` 40).
`python -m bench.freshness` runs it alone (and writes bench/results/freshness/<date>.*);
`make bench` with the rest.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import zmq
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from bench.common import PUBLISHED, publish, record
from kvledger.schemas.codec import Codec
from kvledger.schemas.decisions import HASHES, Decision
from kvledger.schemas.topics import ensure_topic
from kvledger.serving.republish.publisher import Endpoint, Publisher
from kvledger.serving.router.decisions import DecisionLog
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.provisional import Provisional
from tests.helpers.procs import free_port
from tests.helpers.vllm_wheel import vllm_module

MODEL, BLOCK, SOURCE = "fresh-model", 16, "fresh-engine"
STAGES = ("zmq", "kafka", "router", "republish", "decision")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1e3 if len(values) > 1 else float("nan")


class Watch:
    """When each reader first had each hash (perf_counter), filled by its own thread."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[int, float]] = {s: {} for s in STAGES}
        self.stop = threading.Event()

    def zmq_sub(self, port: int, stage: str = "zmq") -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"tcp://127.0.0.1:{port}")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        import msgspec

        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            frames = sock.recv_multipart()
            now = time.perf_counter()
            batch = msgspec.msgpack.decode(frames[-1])
            for event in batch[1]:
                hashes = event.get("block_hashes") if isinstance(event, dict) else event[1]
                if hashes:  # not AllBlocksCleared
                    self.seen[stage].setdefault(hashes[0], now)
        sock.close(0)

    def kafka(self, bootstrap: str, topic: str) -> None:
        consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest", "enable.auto.commit": False,
            "isolation.level": "read_committed", "fetch.wait.max.ms": 5,
        })  # fmt: skip
        consumer.subscribe([topic])
        codec = Codec()
        while not self.stop.is_set():
            msg = consumer.poll(0.05)
            if msg is None or msg.error() is not None:
                continue
            now = time.perf_counter()
            event = codec.decode(msg.value()).event
            hashes = getattr(event, "block_hashes", None)
            if hashes:
                self.seen["kafka"].setdefault(int.from_bytes(hashes[0], "big"), now)
        consumer.close()


def main(batches: int = 200, gap_ms: float = 40.0, blocks: int = 40) -> dict[str, Any]:
    bootstrap = os.environ.get("KVLEDGER_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
    topic = f"bench-fresh-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    ensure_topic(admin, topic, 3)
    port, replay, again = free_port(), free_port(), free_port()
    watch = Watch()
    rng = random.Random(4)
    relay = router = None
    with vllm_module("vllm.distributed.kv_events") as kv:
        publisher = kv.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
        )
        threads = [
            threading.Thread(target=watch.zmq_sub, args=(port,), daemon=True),
            threading.Thread(target=watch.kafka, args=(bootstrap, topic), daemon=True),
            threading.Thread(target=watch.zmq_sub, args=(again, "republish"), daemon=True),
        ]
        republisher = None
        logs: list[DecisionLog] = []
        sent: dict[int, float] = {}
        decisions: dict[int, float] = {}
        try:
            relay = subprocess.Popen(
                [sys.executable, "-m", "kvledger", "relay", "--endpoint", f"tcp://127.0.0.1:{port}",
                 "--replay-endpoint", f"tcp://127.0.0.1:{replay}", "--source", SOURCE,
                 "--model", MODEL, "--group", f"0:full_attention:{BLOCK}", "--topic", topic,
                 "--bootstrap", bootstrap],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            here, there = Provisional(60.0), Provisional(60.0)
            writer = DecisionLog(bootstrap, f"{topic}.decisions", here)
            reader = DecisionLog(bootstrap, f"{topic}.decisions", there)
            logs += [writer, reader]
            writer.start()
            reader.start()
            router = RouterIndex(bootstrap, topic, f"bench-fresh-{uuid.uuid4().hex[:6]}")
            republisher = Publisher(router, [Endpoint(SOURCE, f"tcp://127.0.0.1:{again}")])
            republisher.start()
            router.start()
            for t in threads:
                t.start()
            time.sleep(3)  # the relay resynchronised, the readers assigned
            for _ in range(batches):
                chain = [rng.getrandbits(63) for _ in range(blocks)]
                h = chain[0]
                event = kv.BlockStored(
                    block_hashes=chain, parent_block_hash=None,
                    token_ids=[rng.randrange(50_000) for _ in range(BLOCK * blocks)],
                    block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
                )  # fmt: skip
                start = time.perf_counter()
                publisher.publish(kv.KVEventBatch(ts=time.time(), events=[event]))
                sent[h] = start
                key = [h.to_bytes(8, "big")]
                deadline = start + 5
                while time.perf_counter() < deadline:
                    if router.match(MODEL, 0, key, include_silent=True):
                        watch.seen["router"][h] = time.perf_counter()
                        break
                    time.sleep(0.0005)
                keys = tuple(rng.getrandbits(63) for _ in range(blocks))
                decided = time.perf_counter()
                writer.publish(Decision(MODEL, 0, SOURCE, HASHES, keys))
                decisions[keys[0]] = decided
                while time.perf_counter() < decided + 5:
                    if there.depths(MODEL, 0, HASHES, keys[:1], {}):
                        watch.seen["decision"][keys[0]] = time.perf_counter()
                        break
                    time.sleep(0.0005)
                time.sleep(gap_ms / 1000)
            time.sleep(1)
        finally:
            if relay is not None:  # first: a child process must not outlive a failed run
                relay.terminate()
                relay.wait(30)
            watch.stop.set()
            for t in threads:
                if t.ident is not None:  # started
                    t.join(10)
            if republisher is not None:
                republisher.stop()
            if router is not None:
                router.stop()
            for log in logs:
                log.stop()
            publisher.shutdown()
            admin.delete_topics([topic, f"{topic}.decisions"])
    figures: dict[str, Any] = {"batches": batches, "gap_ms": gap_ms, "blocks": blocks}
    for stage in STAGES:
        seen, began = watch.seen[stage], decisions if stage == "decision" else sent
        waits = [seen[h] - t for h, t in began.items() if h in seen]
        figures[f"{stage}_p50_ms"] = percentile(waits, 50)
        figures[f"{stage}_p99_ms"] = percentile(waits, 99)
        figures[f"{stage}_missing"] = len(began) - len(waits)
    record("freshness", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.freshness", description=__doc__)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=40.0)
    parser.add_argument("--blocks", type=int, default=40, help="blocks per batch")
    args = parser.parse_args()
    figures = main(args.batches, args.gap_ms, args.blocks)
    written = publish({"freshness": figures}, PUBLISHED / "freshness",
                      command="python -m bench.freshness")  # fmt: skip
    print(f"wrote {', '.join(str(w) for w in written)}")
