"""Replication 3 beside replication 1, in one run: what a production cluster costs kvledger.

Two clusters on this machine: the run's single broker (``KVLEDGER_KAFKA_BOOTSTRAP``, topics
with one replica) and a three-broker KRaft cluster of the benchmark's own
(``KVLEDGER_KAFKA_BROKERS=3 scripts/services up kafka`` on free ports with its own state
folder, stopped at the end; topics with three replicas and min.insync.replicas 2). On each,
alternating, ``ROUNDS`` times:

1. publish: a simulated fleet's events through :class:`KVEventPublisher` (acks=all,
   idempotent, as kvledger's producers always are) as fast as it goes, every message
   acknowledged: messages per second (bench/produce.py's path);
2. apply: the router index (``serve --memory``'s) reading that topic from its start:
   messages per second from its first apply to its last;
3. lag: a fleet publishing at a steady ``RATE`` messages per second while the index follows:
   each message's log time to the end of its apply (p50, p99).

Rates are each side's best round, lags the median round's; the ratios are rf3 over rf1.
Targets (issue 74): rf3 apply rate ≥ 0.7 of rf1's, rf3 lag p50 ≤ 2 x rf1's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from bench.common import PUBLISHED, publish, record
from bench.produce import _fleet, _publish
from kvledger.fleet import FleetConfig
from kvledger.replay.pipeline import TimedIndex
from kvledger.schemas.topics import ensure_topic, partition_offsets
from tests.helpers.procs import free_ports

ROUNDS = 3
RATE = 2000.0  # messages per second, for the lag
SERVICES = str(Path(__file__).resolve().parents[1] / "scripts" / "services")


class Cluster:
    """A three-broker cluster of the benchmark's own (scripts/services)."""

    def __init__(self) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="kvledger-bench-x3-"))
        base = free_ports(6)
        self.env = dict(
            os.environ,
            KVLEDGER_KAFKA_BROKERS="3",
            KVLEDGER_STATE_DIR=str(self.state),
            KVLEDGER_KAFKA_PORT=str(base),
            KVLEDGER_KAFKA_CONTROLLER_PORT=str(base + 3),
        )
        self.bootstrap = ",".join(f"127.0.0.1:{base + i}" for i in range(3))

    def up(self) -> None:
        subprocess.run([SERVICES, "up", "kafka"], env=self.env, check=True, timeout=300)

    def down(self) -> None:
        subprocess.run([SERVICES, "down", "kafka"], env=self.env, check=False, timeout=300)


class _Clocked(TimedIndex):
    """The index, with the instants of its first and last apply."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.first: float | None = None
        self.last = 0.0

    def apply(self, batch: Any) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        super().apply(batch)
        self.last = time.perf_counter()


def _round(bootstrap: str, replication: int, requests: int) -> dict[str, float]:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    topics = [f"bench-repl-{replication}-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for topic in topics:
        ensure_topic(admin, topic, 12, replication_factor=replication)
    out: dict[str, float] = {}
    try:
        config = FleetConfig(instances=4, requests=requests, seed=11)
        fleet, publishers = _fleet(bootstrap, config, topics[0], None)
        seconds, acked = _publish(fleet, publishers)
        out["publish_msgs_per_s"] = acked / seconds
        index = _Clocked(
            bootstrap, topics[0], f"bench-repl-{uuid.uuid4().hex[:6]}", block_retention=None
        )
        index.start()
        try:
            index.wait_for(partition_offsets(admin, topics[0]), timeout=300)
        finally:
            index.stop()
        assert index.first is not None
        out["apply_msgs_per_s"] = index.applied_messages / max(index.last - index.first, 1e-9)
        # The lag at a steady rate: the index follows from the start, then the fleet publishes.
        follower = TimedIndex(
            bootstrap, topics[1], f"bench-repl-{uuid.uuid4().hex[:6]}", block_retention=None
        )
        follower.start()
        try:
            time.sleep(3)  # assigned
            steady = FleetConfig(instances=4, requests=max(50, requests // 5), seed=12)
            fleet, publishers = _fleet(bootstrap, steady, topics[1], None)
            fleet.run(rate=RATE)
            for pub in publishers:
                pub.close(120)
            follower.wait_for(partition_offsets(admin, topics[1]), timeout=300)
        finally:
            follower.stop()
        lags = sorted(follower.lags_ms)
        out["lag_p50_ms"] = lags[len(lags) // 2]
        out["lag_p99_ms"] = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
        out["lag_messages"] = float(len(lags))
    finally:
        for future in admin.delete_topics(topics).values():
            future.result(timeout=60)
    return out


def main(requests: int = 400) -> dict[str, Any]:
    single = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    cluster = Cluster()
    cluster.up()
    rounds: dict[int, list[dict[str, float]]] = {1: [], 3: []}
    try:
        for _ in range(ROUNDS):
            rounds[1].append(_round(single, 1, requests))
            rounds[3].append(_round(cluster.bootstrap, 3, requests))
    finally:
        cluster.down()
    figures: dict[str, Any] = {"rounds": ROUNDS, "fleet_requests": requests * 4, "rate": RATE}
    for rf, runs in rounds.items():
        figures[f"rf{rf}_publish_msgs_per_s"] = max(r["publish_msgs_per_s"] for r in runs)
        figures[f"rf{rf}_apply_msgs_per_s"] = max(r["apply_msgs_per_s"] for r in runs)
        figures[f"rf{rf}_lag_p50_ms"] = statistics.median(r["lag_p50_ms"] for r in runs)
        figures[f"rf{rf}_lag_p99_ms"] = statistics.median(r["lag_p99_ms"] for r in runs)
    for what in ("publish_msgs_per_s", "apply_msgs_per_s", "lag_p50_ms", "lag_p99_ms"):
        figures[f"rf3_over_rf1_{what.removesuffix('_msgs_per_s')}"] = (
            figures[f"rf3_{what}"] / figures[f"rf1_{what}"]
        )
    record("replication", figures)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.replication", description=__doc__)
    parser.add_argument("--requests", type=int, default=400, help="requests per engine")
    args = parser.parse_args()
    figures = main(args.requests)
    written = publish({"replication": figures}, PUBLISHED / "replication",
                      command="python -m bench.replication")  # fmt: skip
    print(f"wrote {', '.join(str(w) for w in written)}")
