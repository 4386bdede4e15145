"""Topics kvledger creates are ready when their creation returns (real broker): a client
opened right after ``ensure_topic`` made a topic sees every partition with its leader and
can ask offsets by time, as ``serve --decisions-topic`` does at once. A broker shows a topic
just created without partitions for a moment, and the lab's `serve` once stopped on that
("Failed to get offsets: Local: Invalid argument or configuration")."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.schemas.topics import ensure_topic

pytestmark = pytest.mark.integration


def test_a_created_topic_is_ready_for_the_next_client(
    kafka_bootstrap: str, kafka_admin: AdminClient
) -> None:
    names = [f"test-ready-{uuid.uuid4().hex[:10]}" for _ in range(12)]
    made: list[str] = []
    try:
        for i, name in enumerate(names):
            assert ensure_topic(kafka_admin, name, partitions=1 + i % 3, exact_partitions=False)
            made.append(name)
            client = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": name,
                               "log_level": 3})  # fmt: skip
            try:
                topic = client.list_topics(name, timeout=10).topics[name]
                assert topic.error is None and len(topic.partitions) == 1 + i % 3, name
                assert all(p.leader >= 0 for p in topic.partitions.values()), name
                since = int((time.time() - 5) * 1000)
                asked = [TopicPartition(name, p, since) for p in topic.partitions]
                found = client.offsets_for_times(asked, timeout=10)
                assert [tp.error for tp in found] == [None] * len(asked)
            finally:
                client.close()
        assert not ensure_topic(kafka_admin, names[0], partitions=1, exact_partitions=False)
    finally:
        if made:
            for future in kafka_admin.delete_topics(made).values():
                future.result(30)
