"""A router that restarts, fed by `kvledger republish`: how long until it holds an engine's
whole cache again, and how long the snapshot holds the index's lock.

One source holds ``--blocks`` blocks (chains of 32 blocks of 16 tokens, as after an hour of
an engine's traffic: its whole GPU cache) in a router index. A SUB socket then joins the
source's republished PUB, as a router's subscriber does after its own restart, and follows
what it hears until it holds every block. Figures: seconds to the whole view; seconds the
snapshot held the index's lock (lookups and the tail wait that long); the snapshot's bytes.
(A subscriber of the engine's own stream after its restart holds nothing until the engine
stores again: tests/test_republish.py shows it with Dynamo's indexer.)

`python -m bench.republish` runs it alone; `make bench` with the rest. No services.
"""

from __future__ import annotations

import argparse
import random
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
import zmq

from bench.common import PUBLISHED, publish, record
from kvledger.consumer.core.model import GroupKey, SourceLife
from kvledger.serving.republish.publisher import Endpoint, Publisher
from kvledger.serving.router.index import RouterIndex
from tests.helpers.procs import free_port

SOURCE, MODEL, BLOCK, CHAIN = "bench-engine", "bench-model", 16, 32


def fill(index: RouterIndex, blocks: int) -> None:
    """``blocks`` blocks held by SOURCE on GPU, in chains of CHAIN."""
    rng = random.Random(3)
    store = index.store
    g = store.group(GroupKey(MODEL, 0))
    hid = store.holder_id((SOURCE, "GPU", ""))
    for _ in range(blocks // CHAIN):
        hashes = [rng.getrandbits(64).to_bytes(8, "big") for _ in range(CHAIN)]
        tokens = [rng.randrange(50_000) for _ in range(CHAIN * BLOCK)]
        g.store_run(hashes, None, 0, tokens, BLOCK, False, None, hid, False)
    store.lives[SOURCE] = SourceLife(MODEL, 1, datetime.now(UTC))


def main(blocks: int = 200_000) -> dict[str, Any]:
    index = RouterIndex("unused:9092")
    fill(index, blocks)
    held = blocks // CHAIN * CHAIN
    port = free_port()
    publisher = Publisher(index, [Endpoint(SOURCE, f"tcp://127.0.0.1:{port}")],
                          snapshot_interval_s=0.0)  # fmt: skip
    started = time.perf_counter()
    publisher.start()  # a snapshot of the source at start: timed as the lock's hold
    lock_s = time.perf_counter() - started
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    decoder = msgspec.msgpack.Decoder()
    seen: set[int] = set()
    size = 0
    try:
        joined = time.perf_counter()
        sub.connect(f"tcp://127.0.0.1:{port}")
        deadline = joined + 600
        while len(seen) < held and time.perf_counter() < deadline:
            if not sub.poll(1000):
                continue
            payload = sub.recv_multipart()[-1]
            size += len(payload)
            for event in decoder.decode(payload)[1]:
                if event["type"] == "AllBlocksCleared":
                    seen.clear()
                elif event["type"] == "BlockStored":
                    seen.update(event["block_hashes"])
        whole_s = time.perf_counter() - joined
    finally:
        ctx.destroy(linger=0)
        publisher.stop()
    figures = {
        "blocks_held": held,
        "republish_whole_view_s": round(whole_s, 2),
        "republish_blocks_at_whole_view": len(seen),
        "snapshot_lock_held_s": round(lock_s, 2),
        "snapshot_mib": round(size / 2**20, 1),
    }
    record("republish", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.republish", description=__doc__)
    parser.add_argument("--blocks", type=int, default=200_000)
    args = parser.parse_args()
    figures = main(args.blocks)
    for key, value in figures.items():
        print(f"{key:<40} {value}")
    written = publish({"republish": figures}, PUBLISHED / "republish",
                      command="python -m bench.republish")  # fmt: skip
    print(f"wrote {', '.join(str(w) for w in written)}")
