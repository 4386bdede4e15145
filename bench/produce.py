"""simulate → tracker → encode → produce (acked), beside a raw produce of the same bytes.

Both sides write the same messages (same keys, same encoded values up to event times) to
fresh topics of the same broker in the same run; the raw side uses one confluent-kafka
producer with the publisher's settings. The bytes the raw side sends are recorded in an
untimed run first (a recorder on the timed path would be the full path's cost only), and
each side's producers start before its clock does (an idempotent producer's start takes
~0.5 s here, a large share of a run this size). Each side runs ROUNDS times, alternating;
each side's best round is reported. Target: full path ≥ 0.5 of the raw rate.
"""

from __future__ import annotations

import os
import time
import uuid

from confluent_kafka.admin import AdminClient

from bench.common import capture_produced, raw_produce, record
from kvledger.fleet import Fleet, FleetConfig
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.schemas.topics import ensure_topic

ROUNDS = 3


def _fleet(
    bootstrap: str, config: FleetConfig, topic: str, captured: list[tuple[bytes, bytes]] | None
) -> tuple[Fleet, list[KVEventPublisher]]:
    """A fleet whose engines publish to ``topic``, their publishers started (each has
    announced its groups and had them acknowledged)."""
    publishers: list[KVEventPublisher] = []

    def sink(instance_id: str) -> KVEventPublisher:
        pub = KVEventPublisher(PublisherConfig(bootstrap, instance_id, config.model, topic))
        if captured is not None:
            capture_produced(pub, captured)
        publishers.append(pub)
        return pub

    fleet = Fleet(config, sink)
    for pub in publishers:
        pub.flush(30)
    return fleet, publishers


def _publish(fleet: Fleet, publishers: list[KVEventPublisher]) -> tuple[float, int]:
    """Seconds for the fleet to serve its requests and have every message acknowledged, and
    how many messages that was."""
    start = time.perf_counter()
    fleet.run()
    for pub in publishers:
        pub.close(120)
    return time.perf_counter() - start, sum(p.stats.acked for p in publishers)


def main(instances: int = 4, requests: int = 1000) -> dict[str, float]:
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    config = FleetConfig(instances=instances, requests=requests, seed=11)
    topics: list[str] = []

    def fresh(kind: str) -> str:
        topics.append(f"bench-{kind}-{uuid.uuid4().hex[:8]}")
        ensure_topic(admin, topics[-1], 12)
        return topics[-1]

    captured: list[tuple[bytes, bytes]] = []
    _publish(*_fleet(bootstrap, config, fresh("record"), captured))
    full_s, raw_s, messages = [], [], 0
    for _ in range(ROUNDS):
        full_topic, raw_topic = fresh("full"), fresh("raw")  # both before either clock starts
        seconds, messages = _publish(*_fleet(bootstrap, config, full_topic, None))
        full_s.append(seconds)
        raw_s.append(raw_produce(bootstrap, raw_topic, captured, warm=True))
    admin.delete_topics(topics)

    full_rate = messages / min(full_s)
    raw_rate = len(captured) / min(raw_s)
    figures = {
        "messages": float(messages),
        "full path msg/s (simulate+tracker+encode+produce)": full_rate,
        "raw produce msg/s (same bytes)": raw_rate,
        "ratio full / raw": full_rate / raw_rate,
        "  each round's ratio, worst": min(r / f for r, f in zip(raw_s, full_s, strict=True)),
        "  each round's ratio, best": max(r / f for r, f in zip(raw_s, full_s, strict=True)),
    }
    record("produce", figures)
    return figures


if __name__ == "__main__":
    main()
