"""The services are real: a keyed idempotent produce/consume round trip and a SQL query."""

from __future__ import annotations

from collections import defaultdict

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer

from tests.helpers.kafka import consume_all

pytestmark = pytest.mark.integration

MESSAGES = 1000
KEYS = 20


def test_kafka_keyed_round_trip_across_partitions(
    kafka_bootstrap: str, make_topic, group_id: str
) -> None:
    topic = make_topic("smoke", partitions=3)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "acks": "all"}
    )
    delivered: list[tuple[int, int]] = []
    errors: list[object] = []

    def on_delivery(err, msg) -> None:  # type: ignore[no-untyped-def]
        if err is not None:
            errors.append(err)
        else:
            delivered.append((msg.partition(), msg.offset()))

    for i in range(MESSAGES):
        producer.produce(topic, key=f"k{i % KEYS}", value=str(i).encode(), on_delivery=on_delivery)
        producer.poll(0)
    assert producer.flush(30) == 0
    assert errors == []
    assert len(delivered) == MESSAGES

    messages = consume_all(kafka_bootstrap, topic, group_id, MESSAGES)
    by_key: dict[str, list[int]] = defaultdict(list)
    partitions_of_key: dict[str, set[int]] = defaultdict(set)
    for msg in messages:
        key = msg.key().decode()
        by_key[key].append(int(msg.value()))
        partitions_of_key[key].add(msg.partition())

    assert len(messages) == MESSAGES
    # Every key stays on one partition and keeps its produce order.
    assert all(len(parts) == 1 for parts in partitions_of_key.values())
    for key, values in by_key.items():
        k = int(key[1:])
        assert values == list(range(k, MESSAGES, KEYS))
    # The keys spread over all three partitions.
    assert set().union(*partitions_of_key.values()) == {0, 1, 2}


def test_postgresql_answers_a_query(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text("SHOW server_version_num")).scalar_one()
            total = conn.execute(
                sa.text("SELECT sum(x) FROM generate_series(1, 100) AS x")
            ).scalar()
    finally:
        engine.dispose()
    assert int(version) >= 140000
    assert total == 5050
