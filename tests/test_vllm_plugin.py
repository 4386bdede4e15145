"""The vLLM plugin (kvledger/producer/vllm_plugin.py) on vLLM's own code: vLLM 0.33.0's
``EventPublisherFactory`` and ``ZmqEventPublisher`` from its wheel, the plugin registered
into that factory as vLLM's plugin loader would, real Kafka behind it.

- the engine's ``"zmq"`` publisher, made by the factory, still publishes each batch on its
  ZMQ socket, and the same batches reach the index (a router index following the topic);
- its shutdown says goodbye: the source is closed;
- settings that cannot work stop the engine's start-up with the reason.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec
import pytest
import zmq
from confluent_kafka.admin import AdminClient

from kvledger.producer import vllm_plugin
from kvledger.schemas.topics import ensure_topic
from kvledger.serving.router.index import RouterIndex
from tests.helpers.kafka import private_kafka
from tests.helpers.procs import free_port, free_ports

pytestmark = pytest.mark.integration

MODEL, BLOCK = "plugged-model", 4


def plugged(
    kv: Any, monkeypatch: pytest.MonkeyPatch, source: str, bootstrap: str, topic: str,
    **more: str,
) -> Any:  # fmt: skip
    """vLLM's ``"zmq"`` publisher factory once the plugin registered into it, with the
    engine's environment set for ``source`` (``more``: further KVLEDGER_VLLM_* settings, by
    their last word); vLLM's own factory is restored after the test."""
    env = {
        "KVLEDGER_VLLM_SOURCE": source, "KVLEDGER_KAFKA_BOOTSTRAP": bootstrap,
        "KVLEDGER_TOPIC": topic, "KVLEDGER_VLLM_MODEL": MODEL,
        "KVLEDGER_VLLM_GROUPS": f"0:full_attention:{BLOCK}",
        **{f"KVLEDGER_VLLM_{k.upper()}": v for k, v in more.items()},
    }  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    registry = kv.EventPublisherFactory._registry
    monkeypatch.setitem(registry, "zmq", registry["zmq"])
    vllm_plugin.register()
    return registry["zmq"]


@pytest.mark.parametrize("vllm_kv_events", ["0.33.0", "0.34.0"], indirect=True)
def test_the_engines_zmq_publisher_also_feeds_the_index(
    kafka_bootstrap, make_topic, group_id, vllm_kv_events, monkeypatch
) -> None:
    kv = vllm_kv_events
    topic = make_topic("vllm-plugin")
    registry = kv.EventPublisherFactory._registry
    make = plugged(kv, monkeypatch, "plugged-{rank}", kafka_bootstrap, topic)
    vllm_plugin.register()  # vLLM loads plugins in every process, maybe more than once
    assert registry["zmq"] is make
    assert getattr(make, "kvledger", False)
    port = free_ports(2)
    publisher: Any = make(data_parallel_rank=1, endpoint=f"tcp://*:{port}", topic="t")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port + 1}")  # vLLM offsets a rank's ports by the rank
    router = RouterIndex(kafka_bootstrap, topic, group_id)
    router.start()
    try:
        time.sleep(0.5)  # the subscription reaches the PUB socket (ZMQ's slow joiner)
        chain = [11, 12, 13]
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
            block_hashes=chain, parent_block_hash=None, token_ids=list(range(3 * BLOCK)),
            block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
        )]))  # fmt: skip
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockRemoved(block_hashes=[13], medium="GPU"),
        ]))  # fmt: skip
        keys = [h.to_bytes(8, "big") for h in chain]

        def held() -> list[tuple[str, int]]:
            return [(h.instance, h.matched_blocks) for h in router.match(MODEL, 0, keys)]

        deadline = time.monotonic() + 30
        while held() != [("plugged-1", 2)]:
            assert time.monotonic() < deadline, held()
            time.sleep(0.05)
        heard = []
        while sub.poll(2000) and len(heard) < 2:
            frames = sub.recv_multipart()
            assert frames[0] == b"t"
            heard.append(msgspec.msgpack.decode(frames[2])[1][0]["type"])
        assert heard == ["BlockStored", "BlockRemoved"]  # the ZMQ stream as before
        publisher.shutdown()  # the engine stops: goodbye, the source closed
        deadline = time.monotonic() + 30
        while (life := router.store.lives.get("plugged-1")) is None or life.closed_at is None:
            assert time.monotonic() < deadline, life
            time.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
        router.stop()


def test_batches_the_queue_cannot_take_are_said_lost(
    kafka_bootstrap, make_topic, group_id, vllm_kv_events, monkeypatch
) -> None:
    """A writer's queue of one batch and no wait: in a burst most batches are not taken.
    The engine never waits; each run of them is said lost (EventsLost, counted by the
    index as the plugin counts them), and the stream goes on: what is published after
    holds as published."""
    kv = vllm_kv_events
    topic = make_topic("vllm-plugin-lost")
    make = plugged(kv, monkeypatch, "bursty", kafka_bootstrap, topic, queue="1", max_wait_ms="0")
    publisher: Any = make(data_parallel_rank=0, endpoint=f"tcp://*:{free_port()}")
    router = RouterIndex(kafka_bootstrap, topic, group_id)
    router.start()

    def store(hashes: list[int]) -> Any:
        return kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=list(range(BLOCK * len(hashes))),
            block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
        )])  # fmt: skip

    try:
        started = time.perf_counter()
        for i in range(300):
            publisher.publish(store([1000 + i]))
        burst = time.perf_counter() - started
        assert publisher.lost_batches > 0, "the burst fitted: the test needs losses"
        assert burst < 5  # nothing waited for Kafka
        # From here a bound that lets every batch through: what follows must be published.
        publisher.settings = dataclasses.replace(publisher.settings, max_wait_s=30.0)
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockRemoved(block_hashes=[1000 + i for i in range(300)], medium="GPU"),
        ]))  # fmt: skip
        publisher.publish(store([7, 8]))
        keys = [h.to_bytes(8, "big") for h in (7, 8)]
        deadline = time.monotonic() + 30
        while [(h.instance, h.matched_blocks) for h in router.match(MODEL, 0, keys)] != [
            ("bursty", 2)
        ]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with router.lock:
            state = router.store.sources[("bursty", MODEL, 0)]
        assert state.lost_gaps >= 1
        assert state.lost_batches == publisher.lost_batches
        publisher.shutdown()
    finally:
        router.stop()


OUTAGE_S = 60.0


def test_a_minute_without_kafka_loses_nothing_and_stalls_nothing(
    tmp_path, group_id, vllm_kv_events, monkeypatch
) -> None:
    """A broker of the test's own stopped for a minute while the engine goes on publishing
    (a batch every 0.2 s, heartbeats between): no publish call waits, nothing is lost, and
    once the broker is back the index holds every block the engine stored."""
    kv = vllm_kv_events
    with private_kafka(tmp_path / "state") as broker:
        topic = "kv-events"
        ensure_topic(AdminClient({"bootstrap.servers": broker.bootstrap}), topic, 3)
        make = plugged(kv, monkeypatch, "steady", broker.bootstrap, topic)
        publisher: Any = make(data_parallel_rank=0, endpoint=f"tcp://*:{free_port()}")
        router = RouterIndex(broker.bootstrap, topic, group_id)
        router.start()
        stored: list[int] = []
        slowest = 0.0

        def store() -> None:
            nonlocal slowest
            h = 5000 + len(stored)
            batch = kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
                block_hashes=[h], parent_block_hash=stored[-1] if stored else None,
                token_ids=list(range(BLOCK)), block_size=BLOCK, lora_id=None, medium="GPU",
                lora_name=None,
            )])  # fmt: skip
            started = time.perf_counter()
            publisher.publish(batch)
            slowest = max(slowest, time.perf_counter() - started)
            stored.append(h)

        try:
            for _ in range(10):
                store()
            broker.stop()
            until = time.monotonic() + OUTAGE_S
            while time.monotonic() < until:
                store()
                time.sleep(0.2)
            broker.start()
            store()
            keys = [h.to_bytes(8, "big") for h in stored]
            deadline = time.monotonic() + 120
            while [(h.instance, h.matched_blocks) for h in router.match(MODEL, 0, keys)] != [
                ("steady", len(stored))
            ]:
                assert time.monotonic() < deadline, router.match(MODEL, 0, keys)
                time.sleep(0.2)
            assert publisher.lost_batches == 0
            assert slowest < 0.05, f"a publish call waited {slowest:.3f} s"
            print(f"{len(stored)} batches across a {OUTAGE_S:.0f} s outage; slowest call "
                  f"{slowest * 1e3:.2f} ms")  # fmt: skip
            publisher.shutdown()
        finally:
            router.stop()


def test_deliveries_failed_for_good_start_a_new_epoch_without_stalling(
    tmp_path, group_id, vllm_kv_events, monkeypatch
) -> None:
    """Kafka away longer than its client holds messages (here 2 s, by the operator's
    client settings): deliveries fail, the plugin says the batches lost and opens a new
    publisher (a new epoch) without ever holding the scheduler's thread; once the broker is
    back the index follows the engine again."""
    kv = vllm_kv_events
    settings = tmp_path / "kafka.properties"
    settings.write_text("message.timeout.ms=2000\n")
    with private_kafka(tmp_path / "state") as broker:
        topic = "kv-events"
        ensure_topic(AdminClient({"bootstrap.servers": broker.bootstrap}), topic, 3)
        monkeypatch.setenv("KVLEDGER_KAFKA_CONFIG", str(settings))
        make = plugged(kv, monkeypatch, "failing", broker.bootstrap, topic)
        publisher: Any = make(data_parallel_rank=0, endpoint=f"tcp://*:{free_port()}")
        router = RouterIndex(broker.bootstrap, topic, group_id)
        router.start()
        slowest, next_hash = 0.0, 9000

        def store() -> bytes:
            nonlocal slowest, next_hash
            next_hash += 1
            batch = kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
                block_hashes=[next_hash], parent_block_hash=None, token_ids=list(range(BLOCK)),
                block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
            )])  # fmt: skip
            started = time.perf_counter()
            publisher.publish(batch)
            slowest = max(slowest, time.perf_counter() - started)
            return next_hash.to_bytes(8, "big")

        def held(key: bytes) -> bool:
            return [h.instance for h in router.match(MODEL, 0, [key])] == ["failing"]

        try:
            first = store()
            deadline = time.monotonic() + 30
            while not held(first):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with router.lock:
                epoch = router.store.lives["failing"].epoch
            broker.stop()
            until = time.monotonic() + 14
            while time.monotonic() < until:
                store()
                time.sleep(0.2)
            assert publisher.lost_batches > 0
            broker.start()
            deadline = time.monotonic() + 90
            while True:  # the engine goes on storing; each block is looked for 0.2 s after
                latest = store()
                time.sleep(0.2)
                if held(latest):
                    break
                assert time.monotonic() < deadline, "the index never followed the engine again"
            with router.lock:
                assert router.store.lives["failing"].epoch > epoch  # a new publisher
            assert not held(first)  # the old epoch's blocks ended with it (never over-claimed)
            assert slowest < 0.05, f"a publish call waited {slowest:.3f} s"
            publisher.shutdown()
        finally:
            router.stop()


BASE = {"KVLEDGER_VLLM_SOURCE": "e", "KVLEDGER_KAFKA_BOOTSTRAP": "b"}


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"KVLEDGER_VLLM_SOURCE": "e"}, "KVLEDGER_KAFKA_BOOTSTRAP is not"),
        ({"KVLEDGER_VLLM_SOURCE": " "}, "KVLEDGER_VLLM_SOURCE is empty"),
        ({**BASE, "KVLEDGER_VLLM_MAX_WAIT_MS": "soon"}, "must be a number"),
        ({**BASE, "KVLEDGER_VLLM_QUEUE": "0"}, "at least 1"),
        ({**BASE, "KVLEDGER_KAFKA_CONFIG": "/nonexistent/kafka.properties"}, "cannot read"),
    ],
)
def test_a_bad_setting_stops_the_start_with_its_reason(env: dict[str, str], reason: str) -> None:
    with pytest.raises(vllm_plugin.PluginConfigError, match=reason):
        vllm_plugin.PluginSettings.from_env(env)


def test_ranks_name_their_sources() -> None:
    settings = vllm_plugin.PluginSettings.from_env(BASE)
    assert (settings.source_for(0), settings.source_for(2)) == ("e", "e-dp2")
    named = vllm_plugin.PluginSettings.from_env({**BASE, "KVLEDGER_VLLM_SOURCE": "n{rank}x"})
    assert named.source_for(3) == "n3x"
    assert (settings.max_wait_s, settings.queue, settings.topic) == (0.001, 1024, "kv-events")
