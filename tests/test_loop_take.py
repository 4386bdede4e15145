"""consumer/loop.py's take() on a real broker: a message is handed over when it arrives,
not when the batch fills or the wait runs out (``Consumer.consume(n, timeout)`` waited out
its whole timeout for fewer than n messages, so every event of a light stream reached the
router's index 0.2 s late)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kvledger.consumer.loop import take

pytestmark = pytest.mark.integration


def test_a_message_is_taken_when_it_arrives(
    kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    topic = make_topic("take", partitions=1)
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": uuid.uuid4().hex,
                         "enable.auto.commit": False})  # fmt: skip
    consumer.assign([TopicPartition(topic, 0, 0)])
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    try:
        assert take(consumer, 500, 0.5) == []  # nothing there: the wait, then nothing
        for value in (b"a", b"b", b"c"):
            producer.produce(topic, value)
        producer.flush(30)
        started = time.monotonic()
        got = []
        while len(got) < 3:
            got += [m.value() for m in take(consumer, 500, 30.0) if m.error() is None]
        assert got == [b"a", b"b", b"c"]
        assert time.monotonic() - started < 15  # not the 30 s a batch of 500 would wait
        producer.produce(topic, b"d")
        producer.flush(30)
        assert [m.value() for m in take(consumer, 1, 30.0)] == [b"d"]
    finally:
        consumer.close()
