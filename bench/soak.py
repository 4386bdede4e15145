"""Backpressure soak: a consumer 1,000,000 messages behind catches up in bounded memory.

A simulated fleet publishes about 1,000,000 messages first; then `kvledger consume
--until-caught-up` runs as a child process. Figures: catch-up rate and the consumer's peak
RSS (the bound comes from queued.max.messages.kbytes, 16 MiB by default, and the batch size).
Run with `python -m bench.soak` (services up); not part of `make test`.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import uuid

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from bench.common import record
from kvledger.consumer.db import connect, create_database, migrate
from kvledger.fleet import FleetConfig
from kvledger.schemas.topics import ensure_topic
from kvledger.simulate_cmd import run_simulation


def main(target: int = 1_000_000) -> dict[str, float]:
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    server = os.environ["KVLEDGER_DATABASE_URL"]
    db = create_database(server, f"{sa.engine.make_url(server).database}_soak", replace=True)
    migrate(db)
    topic = f"soak-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    ensure_topic(admin, topic, 12)
    # About 22 messages per request and instance.
    fleet = FleetConfig(instances=4, requests=target // 88, seed=17)
    start = time.perf_counter()
    sim = run_simulation(bootstrap, topic, fleet, partitions=12, show_progress=True)
    publish_seconds = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "consume", "--bootstrap", bootstrap,
         "--database-url", db, "--topic", topic, "--consumer-group", "soak", "--until-caught-up",
         "--no-migrate", "--dlq-topic", f"{topic}.dlq"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    consume_seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with connect(db, autocommit=True) as conn:
        (events,) = conn.execute("SELECT count(*) FROM kvledger.events").fetchone() or (0,)
    admin.delete_topics([topic, f"{topic}.dlq"])
    figures = {
        "messages queued": float(sim.produced),
        "messages applied or rejected": float(events),
        "publish msg/s": sim.produced / publish_seconds,
        "catch-up msg/s": events / consume_seconds,
        "consumer peak RSS MiB": peak_kib / 1024,
    }
    record("soak", figures)
    return figures


if __name__ == "__main__":
    main()
