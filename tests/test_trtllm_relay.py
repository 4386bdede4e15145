"""`kvledger relay --engine trtllm` polling a TensorRT-LLM endpoint, into real Kafka and a
real PostgreSQL index. TensorRT-LLM's own code cannot run here (no wheel on PyPI): the
endpoint is tests/helpers/trtllm_fixture.py, serving events in the JSON shape of
TensorRT-LLM's ``KVCacheEventSerializer`` as ``trtllm-serve``'s ``POST /kv_cache_events``
does (each poll drains the queue).

One engine's life: events from before the relay started (the first poll drains them all,
from id 0), chains stored and extended, blocks moved to the host pool and back (a removal
plus a store each), evictions, a block with extra token ids, the endpoint answering 500s
then HTML (retried with back-off, counted), events lost before any poll (an id gap:
recorded lost, the source cleared), and an engine restart (ids from 0: a new epoch). The
index ends equal to the truth built from what the engine emitted. Then events no engine
should send: each recorded lost, none stopping the relay.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from kvledger.consumer.db import connect
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.relay import Relay
from kvledger.serving.lookup import PrefixIndex
from tests.helpers.consuming import consume, lost_ranges, residencies_of
from tests.helpers.trtllm_fixture import TrtllmServe, truth

pytestmark = pytest.mark.integration
MODEL, SOURCE = "m", "trt-0"


@pytest.fixture
def serve() -> Iterator[TrtllmServe]:
    s = TrtllmServe()
    yield s
    s.close()


def trtllm_relay(serve: TrtllmServe, bootstrap: str, topic: str) -> Relay:
    """A relay polling ``serve`` every 50 ms (not started)."""
    return Relay(RelayConfig(
        endpoint=serve.endpoint, source=SOURCE, model=MODEL, bootstrap_servers=bootstrap,
        topic=topic, groups=[parse_group("0:full_attention:4", MODEL)], engine="trtllm",
        poll_interval_s=0.05, heartbeat_interval_s=1.0,
    ))  # fmt: skip


def relayed(relay: Relay, serve: TrtllmServe, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while relay.ranks[0].committed_seq != serve.next_id - 1 or serve.queue:
        assert not relay.errors, relay.errors
        assert time.monotonic() < deadline, (relay.ranks[0].committed_seq, serve.next_id - 1)
        time.sleep(0.05)


def test_a_trtllm_engines_life_through_the_relay_equals_the_truth(
    kafka_bootstrap: str, fresh_database: str, make_topic: object, group_id: str,
    serve: TrtllmServe,
) -> None:  # fmt: skip
    topic = make_topic("trtllm", partitions=3)  # type: ignore[operator]
    serve.emit({"type": "created", "num_blocks_per_cache_level": [128, 512]})
    system = serve.store()
    serve.store(system[-1])
    relay = trtllm_relay(serve, kafka_bootstrap, topic)
    relay.start()
    lost: set[tuple[int, int]] = set()
    try:
        assert relay.ready(60)
        tail = serve.store(system[-1])
        serve.move(tail[-1], 1)  # offloaded to the host pool
        serve.move(system[-1], 1)
        serve.move(system[-1], 0)  # and back
        serve.store(extra=True)  # multimodal tokens: an extra key
        serve.remove(tail[-1:])  # leaves the host pool it was moved to
        relayed(relay, serve)

        serve.answer = "500"
        time.sleep(0.5)
        serve.answer = "html"
        time.sleep(0.5)
        serve.answer = "ok"
        first = serve.next_id
        serve.store(system[-1], lose=True)  # never polled: the id gap is a loss
        serve.store(lose=True)
        lost |= {(0, first), (0, first + 1)}
        serve.store()
        relayed(relay, serve)

        serve.restart()  # ids from 0
        kept = serve.store()
        serve.move(kept[0], 1)
        relayed(relay, serve)
    finally:
        relay.stop()
    metrics = relay.metrics
    assert metrics.poll_errors.labels(SOURCE)._value.get() > 0
    assert metrics.engine_restarts.labels(SOURCE)._value.get() == 1
    assert metrics.unrecoverable.labels(SOURCE)._value.get() == 1

    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    got, ranges = residencies_of(fresh_database, SOURCE), lost_ranges(fresh_database, SOURCE)
    want = truth(serve.log, lost)
    with connect(fresh_database, autocommit=True) as conn:
        hashes = [(h % 2**64).to_bytes(8, "big") for h in kept]
        holders = PrefixIndex(conn).match(MODEL, 0, hashes, "block", True, timedelta(hours=1))
    assert want and got == want
    assert ranges == [(first, first + 1)]
    # the chain's first block moved to the host pool: CPU holds the prefix's first block,
    # the GPU no prefix at all
    assert [(h.medium, h.matched_blocks) for h in holders] == [("CPU", 1)]


def test_no_event_stops_the_relay(
    kafka_bootstrap: str, fresh_database: str, make_topic: object, group_id: str,
    serve: TrtllmServe,
) -> None:  # fmt: skip
    """What once stopped the relay (and, polled again, its successor): a window given as a
    list or an object, and an id at the end of the range after a gap (its 2**63 lost events
    drove the lost-batches counter to 9.2e18). Each is recorded lost; the relay goes on."""
    topic = make_topic("trtllm-odd", partitions=3)  # type: ignore[operator]
    relay = trtllm_relay(serve, kafka_bootstrap, topic)
    relay.start()
    try:
        assert relay.ready(60)
        kept = serve.store()
        odd = [serve.emit({"type": "removed", "block_hashes": kept[:1]}, window_size=w)
               for w in ([1], {"a": 1})]  # fmt: skip
        serve.store()
        skipped = serve.emit({"type": "removed", "block_hashes": kept[1:]}, lose=True)
        serve.next_id = 2**63 - 1
        last = serve.store()
        relayed(relay, serve)
        assert relay.alive()
    finally:
        relay.stop()
    lost_batches = relay.metrics.lost_batches.labels(SOURCE)._value.get()
    assert lost_batches == 2 + 2**32  # the two odd ones, and the gap counted to its bound
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=50)
    want = truth(serve.log, {(0, i) for i in (*odd, skipped)})
    assert residencies_of(fresh_database, SOURCE) == want
    assert {k[1] for k in want} == {(h % 2**64).to_bytes(8, "big") for h in last}
    assert lost_ranges(fresh_database, SOURCE) == [(odd[0], odd[0]), (odd[1], odd[1]),
                                                   (skipped, 2**63 - 2)]  # fmt: skip
