"""The producer library against a real broker: order, no loss, epochs, failures made loud."""

from __future__ import annotations

import itertools
import random
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvledger.fleet import FULL_GROUP, SLIDING_GROUP
from kvledger.producer.config import PublisherConfig
from kvledger.producer.errors import DeliveryError, MessageTooLargeError, PublishError
from kvledger.producer.publisher import KVEventPublisher
from kvledger.producer.tracker import Medium, OffloadingEvent, make_offload_key
from kvledger.producer.vllm import FIELDS
from kvledger.schemas import events
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Goodbye, GroupSpec
from tests.helpers.kafka import consume_all, private_kafka
from tests.helpers.procs import free_port

pytestmark = pytest.mark.integration


def stored(rng: random.Random, group: int, n_blocks: int = 2, block_size: int = 16) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(rng.randbytes(32) for _ in range(n_blocks)),
        parent_block_hash=rng.randbytes(32) if rng.random() < 0.8 else None,
        token_ids=tuple(rng.randrange(32000) for _ in range(n_blocks * block_size)),
        block_size=block_size,
        lora_id=None,
        medium=rng.choice(["CPU", "STORAGE"]),
        lora_name=rng.choice([None, "adapter-a"]),
        group_idx=group,
        kv_cache_spec_kind="full_attention",
        locality=rng.choice([None, "LOCAL"]),
        ownership=rng.choice([None, "disk"]),
        token_start=rng.randrange(0, 4096, 16),
        partial=False,
    )


def test_order_and_contiguous_sequence_per_key(
    kafka_bootstrap: str, make_topic, group_id: str
) -> None:
    topic = make_topic("order", partitions=6)
    rng = random.Random(1)
    sent: dict[str, list[BlockStored]] = defaultdict(list)
    publishers = [
        KVEventPublisher(
            PublisherConfig(kafka_bootstrap, f"src-{i}", "m", topic=topic, hash_format="digest")
        )
        for i in range(4)
    ]
    for pub in publishers:
        pub.announce_groups([FULL_GROUP, SLIDING_GROUP])
    for _ in range(400):
        pub = rng.choice(publishers)
        event = stored(rng, rng.choice([0, 1]))
        pub.publish_events([event])
        sent[f"{pub.config.source_id}/{event.group_idx}"].append(event)
    for pub in publishers:
        pub.close(30)
    messages = consume_all(kafka_bootstrap, topic, group_id, 400 + 8 + 4)  # + 4 goodbyes
    codec = Codec()
    got: dict[str, list[BlockStored]] = defaultdict(list)
    seqs: dict[str, list[int]] = defaultdict(list)
    partitions: dict[str, set[int]] = defaultdict(set)
    for msg in messages:
        key = msg.key().decode()
        env = codec.decode(msg.value())
        assert key == f"{env.source}/{_group(env.event)}"
        seqs[key].append(env.seq)
        partitions[key].add(msg.partition())
        if isinstance(env.event, BlockStored):
            got[key].append(env.event)
        elif isinstance(env.event, Goodbye):  # the last word, on the source's first group
            assert key.endswith("/0") and env.seq == len(sent[key]) + 1
        else:
            assert isinstance(env.event, GroupSpec) and env.seq == 0
    assert got == sent
    for key, numbers in seqs.items():
        assert numbers == list(range(len(numbers))), key
    assert all(len(p) == 1 for p in partitions.values())
    assert len(set().union(*partitions.values())) > 1


def _group(event: object) -> int:
    group = getattr(event, "group_idx", None)
    return group if group is not None else 0


def test_no_loss_50000_events_every_field(kafka_bootstrap: str, make_topic, group_id: str) -> None:
    topic = make_topic("noloss", partitions=12)
    rng = random.Random(7)
    total = 50_000
    pubs = {
        s: KVEventPublisher(
            PublisherConfig(kafka_bootstrap, s, "m", topic=topic, hash_format="digest")
        )
        for s in ("a", "b", "c", "d")
    }
    expected: dict[tuple[str, int], list[object]] = defaultdict(list)
    for i in range(total):
        source = "abcd"[i % 4]
        group = (i // 4) % 2
        if rng.random() < 0.7:
            event: object = stored(rng, group, n_blocks=rng.randint(1, 4))
        else:
            event = BlockRemoved(
                tuple(rng.randbytes(32) for _ in range(rng.randint(1, 4))), "CPU", group, None, None
            )
        pubs[source].publish_events([event])  # type: ignore[list-item]
        expected[(source, group)].append(event)
    for source, pub in pubs.items():
        pub.close(60)
        assert pub.stats.acked == pub.stats.produced
        expected[(source, 0)].append(Goodbye(group_idx=0))
    messages = consume_all(kafka_bootstrap, topic, group_id, total + 4, timeout=120)
    assert len(messages) == total + 4
    codec = Codec()
    got: dict[tuple[str, int], list[object]] = defaultdict(list)
    for msg in messages:
        env = codec.decode(msg.value())
        assert env.model == "m" and env.epoch == pubs[env.source].epoch
        got[(env.source, _group(env.event))].append(env.event)
    assert got == expected


def test_restart_starts_new_epoch(kafka_bootstrap: str, make_topic, group_id: str) -> None:
    topic = make_topic("epoch", partitions=3)
    rng = random.Random(3)
    config = PublisherConfig(kafka_bootstrap, "engine-x", "m", topic=topic)
    first = KVEventPublisher(config)
    first.publish_events([stored(rng, 0) for _ in range(5)])
    first.close()
    time.sleep(0.01)
    second = KVEventPublisher(config)
    second.publish_events([stored(rng, 0) for _ in range(3)])
    second.close()
    assert second.epoch > first.epoch
    codec = Codec()
    envs = [codec.decode(m.value()) for m in consume_all(kafka_bootstrap, topic, group_id, 10)]
    assert [(e.epoch, e.seq) for e in envs] == [(first.epoch, i) for i in range(6)] + [
        (second.epoch, i) for i in range(4)
    ]
    assert isinstance(envs[5].event, Goodbye) and isinstance(envs[9].event, Goodbye)


def test_tracker_events_and_int64_hashes(kafka_bootstrap: str, make_topic, group_id: str) -> None:
    """publish() runs the tracker; hashes go out in vLLM's int64 form (last 8 bytes)."""
    topic = make_topic("tracker", partitions=3)
    pub = KVEventPublisher(PublisherConfig(kafka_bootstrap, "engine-t", "m", topic=topic))
    pub.announce_groups([FULL_GROUP])

    class Req:
        block_hashes = [bytes([i]) * 32 for i in range(8)]
        all_token_ids = list(range(128))
        lora_request = None

    key = make_offload_key(Req.block_hashes[3], 0)
    pub.tracker.record_store(Req(), FULL_GROUP, 0, key)
    assert pub.publish([OffloadingEvent([key], Medium.CPU, removed=False)]) == 1
    pub.publish([OffloadingEvent([key], Medium.CPU, removed=True)])
    assert pub.clear_all() == 1
    pub.close()
    codec = Codec()
    envs = [codec.decode(m.value()) for m in consume_all(kafka_bootstrap, topic, group_id, 5)]
    kinds = [type(e.event).__name__ for e in envs]
    assert kinds == ["GroupSpec", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Goodbye"]
    assert [e.seq for e in envs] == [0, 1, 2, 3, 4]
    spec = envs[0].event
    assert spec == GroupSpec("m", 0, "full_attention", 32, 16, None)
    block = envs[1].event
    assert isinstance(block, BlockStored)
    assert block.block_hashes == (bytes([1]) * 8, bytes([3]) * 8)
    assert block.parent_block_hash is None and block.token_ids == tuple(range(64))
    assert envs[2].event == BlockRemoved((bytes([1]) * 8, bytes([3]) * 8), "CPU", 0, None, None)
    assert envs[3].event == AllBlocksCleared(group_idx=0, medium="GPU")


def test_vllm_style_batch(kafka_bootstrap: str, make_topic, group_id: str) -> None:
    topic = make_topic("vllm", partitions=3)

    class BlockStored:  # vLLM's class and field names, int hashes
        def __init__(self) -> None:
            self.block_hashes = [2**64 - 1, 5]
            self.parent_block_hash = 7
            self.token_ids = [1, 2, 3, 4]
            self.block_size = 2
            self.lora_id = None
            self.medium = "GPU"
            self.lora_name = None
            self.extra_keys = [("x", b"\x01"), None]
            self.group_idx = 0

    class AllBlocksCleared:
        pass

    class Batch:
        ts = 1.0
        events = [BlockStored(), AllBlocksCleared()]

    pub = KVEventPublisher(PublisherConfig(kafka_bootstrap, "engine-v", "m", topic=topic))
    assert pub.publish_vllm_batch(Batch()) == 2
    pub.close()
    codec = Codec()
    envs = [codec.decode(m.value()) for m in consume_all(kafka_bootstrap, topic, group_id, 3)]
    assert envs[2].event == Goodbye(group_idx=0)
    ev = envs[0].event
    assert ev == type(ev)(
        block_hashes=(b"\xff" * 8, (5).to_bytes(8, "big")),
        parent_block_hash=(7).to_bytes(8, "big"),
        token_ids=(1, 2, 3, 4),
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=('["x", "01"]', None),
        group_idx=0,
    )
    assert envs[1].event == events.AllBlocksCleared(group_idx=0, medium="GPU")


class _VllmStored:  # a kvledger store as vLLM's object (its class name, its fields)
    def __init__(self, event: BlockStored) -> None:
        for name in FIELDS["BlockStored"]:
            setattr(self, name, getattr(event, name))


_VllmStored.__name__ = "BlockStored"


def test_a_message_too_large_is_refused_alone_without_a_sequence_gap(
    kafka_bootstrap: str, make_topic
) -> None:
    """The topic takes 2,000-byte messages: a 5 kB event of kvledger's own in the middle of
    a call is refused when produced (MessageTooLargeError names it); the call's other events
    are produced with contiguous sequence numbers, and the goodbye after it is delivered."""
    topic = make_topic("small", partitions=1, **{"max.message.bytes": "2000"})
    rng = random.Random(5)
    pub = KVEventPublisher(PublisherConfig(kafka_bootstrap, "engine-big", "m", topic=topic))
    small, big = (
        stored(rng, 0, n_blocks=1, block_size=16),
        stored(rng, 0, n_blocks=64, block_size=16),
    )
    three = [small, big, stored(rng, 0, n_blocks=1, block_size=16)]
    with pytest.raises(MessageTooLargeError, match="1 event") as info:
        pub.publish_events(three)
    assert info.value.refused and "BlockStored" in info.value.refused[0]
    pub.close(30)  # everything else acknowledged, the goodbye included
    assert pub.stats.failed == 0 and pub.stats.acked == 3
    codec = Codec()
    envs = [codec.decode(m.value()) for m in consume_all(kafka_bootstrap, topic, "g-big", 3)]
    assert [e.seq for e in envs] == [0, 1, 2] and isinstance(envs[2].event, Goodbye)


def test_vllms_store_larger_than_a_message_is_produced_as_chained_stores(
    kafka_bootstrap: str, make_topic
) -> None:
    """The same 5 kB store from vLLM (handed to the writer thread, prepared, framed and
    produced there) leaves as several stores that each fit, chained block to block: every
    block arrives, in order, and nothing is refused."""
    topic = make_topic("small", partitions=1, **{"max.message.bytes": "2000"})
    rng = random.Random(5)
    pub = KVEventPublisher(PublisherConfig(kafka_bootstrap, "engine-big", "m", topic=topic))
    three = [stored(rng, 0, n_blocks=n, block_size=16) for n in (1, 64, 1)]
    batch = SimpleNamespace(ts=1.0, events=[_VllmStored(e) for e in three])
    assert pub.publish_vllm_batch(batch) == 3
    pub.close(30)
    codec = Codec()
    acked = pub.stats.acked
    envs = [codec.decode(m.value()) for m in consume_all(kafka_bootstrap, topic, "g-big", acked)]
    assert pub.stats.failed == 0 and acked > 5 and isinstance(envs[-1].event, Goodbye)
    assert [e.seq for e in envs] == list(range(acked))
    stores = [e.event for e in envs[:-1]]
    assert all(isinstance(e, BlockStored) for e in stores)
    sent = [events.with_int64_hashes(e) for e in three]  # the publisher's hash form
    assert [h for e in stores for h in e.block_hashes] == [h for e in sent for h in e.block_hashes]
    assert [t for e in stores for t in e.token_ids] == [t for e in three for t in e.token_ids]
    middle = stores[1:-1]
    assert all(b.parent_block_hash == a.block_hashes[-1] for a, b in itertools.pairwise(middle))


def test_a_broker_down_at_start_is_reported_within_the_bound() -> None:
    from kvledger.producer.errors import BrokerUnreachableError

    port = free_port()
    start = time.monotonic()
    with pytest.raises(BrokerUnreachableError, match="answered within 2 s"):
        KVEventPublisher(PublisherConfig(f"127.0.0.1:{port}", "engine-x", "m", startup_timeout_s=2))
    assert time.monotonic() - start < 10


def test_broker_stopped_mid_run_makes_close_raise(tmp_path: Path) -> None:
    """A throwaway broker of our own is stopped while messages are in flight."""
    from confluent_kafka.admin import AdminClient

    from kvledger.schemas.topics import ensure_topic

    with private_kafka(tmp_path / "state") as broker:
        bootstrap = broker.bootstrap
        ensure_topic(AdminClient({"bootstrap.servers": bootstrap}), "kv-events", 3)
        rng = random.Random(9)
        # One waits longer than its close does; the other's messages time out first. No
        # heartbeats: on a loaded machine the broker's stop can outlast the interval, and a
        # heartbeat would be one more undelivered message than the count below.
        waiting, failing = (
            KVEventPublisher(
                PublisherConfig(bootstrap, f"engine-{name}", "m", heartbeat_interval_s=0,
                                kafka={"message.timeout.ms": timeout_ms})
            )
            for name, timeout_ms in (("s", 60000), ("t", 3000))
        )  # fmt: skip
        for pub in (waiting, failing):
            pub.publish_events([stored(rng, 0) for _ in range(100)])
            pub.flush(30)
        broker.stop()
        for pub in (waiting, failing):
            pub.publish_events([stored(rng, 0) for _ in range(100)])
        start = time.monotonic()
        with pytest.raises(PublishError, match=r"unacknowledged"):
            waiting.close(timeout=5)
        assert time.monotonic() - start < 15
        # Failures are reported (librdkafka reports nothing else): the first 100 count as
        # acknowledged, the second 100 and the goodbye as failed.
        with pytest.raises(DeliveryError, match=r"101 message\(s\) were not delivered"):
            failing.close(timeout=30)
        assert (failing.stats.acked, failing.stats.failed) == (100, 101)
