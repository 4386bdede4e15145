"""simulate → tracker → encode → produce (acked), beside a raw produce of the same bytes.

Both sides write the same messages (same keys, same encoded values up to event times) to
fresh topics of the same broker in the same run; the raw side uses one confluent-kafka
producer with the publisher's settings. Target: full path ≥ 0.5 of the raw rate.
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


def main(instances: int = 4, requests: int = 250) -> dict[str, float]:
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    fleet = FleetConfig(instances=instances, requests=requests, seed=11)
    run = uuid.uuid4().hex[:8]

    # Full path, timed: simulation (hashing included), tracker, encode, produce, acks.
    full_topic = f"bench-full-{run}"
    ensure_topic(admin, full_topic, 12)
    captured: list[tuple[bytes, bytes]] = []
    publishers: list[KVEventPublisher] = []

    def sink(instance_id: str) -> KVEventPublisher:
        pub = KVEventPublisher(PublisherConfig(bootstrap, instance_id, fleet.model, full_topic))
        capture_produced(pub, captured)
        publishers.append(pub)
        return pub

    start = time.perf_counter()
    Fleet(fleet, sink).run()
    for pub in publishers:
        pub.close(120)
    full_seconds = time.perf_counter() - start
    messages = sum(p.stats.acked for p in publishers)

    # Raw baseline: the captured bytes, one producer, same settings, acked.
    raw_topic = f"bench-raw-{run}"
    ensure_topic(admin, raw_topic, 12)
    raw_seconds = raw_produce(bootstrap, raw_topic, captured)
    admin.delete_topics([full_topic, raw_topic])

    full_rate = messages / full_seconds
    raw_rate = len(captured) / raw_seconds
    figures = {
        "messages": float(messages),
        "full path msg/s (simulate+tracker+encode+produce)": full_rate,
        "raw produce msg/s (same bytes)": raw_rate,
        "ratio full / raw": full_rate / raw_rate,
    }
    record("produce", figures)
    return figures


if __name__ == "__main__":
    main()
