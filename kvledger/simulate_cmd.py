"""`kvledger simulate`: drive a simulated fleet against a real broker."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from kvledger import settings
from kvledger.fleet import Fleet, FleetConfig, FleetSummary
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.progress import Progress
from kvledger.schemas.codec import Codec
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.replication import warn_under_replicated
from kvledger.schemas.topics import DEFAULT_PARTITIONS, STARTUP_TIMEOUT_S, ensure_topic
from kvledger.sinks import EventSink

logger = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    summary: FleetSummary
    produced: int
    acked: int
    by_type: dict[str, int]
    seconds: float


def run_simulation(  # noqa: PLR0913 - where, then options with defaults, set by name
    bootstrap: str,
    topic: str,
    fleet: FleetConfig,
    partitions: int = DEFAULT_PARTITIONS,
    show_progress: bool = True,
    rate: float | None = None,
    sinks: Mapping[str, EventSink] | None = None,
    kafka: Mapping[str, str] | None = None,
    codec: Codec | None = None,
) -> SimulationResult:
    """simulate → tracker → publisher → Kafka, one publisher per simulated instance (or the
    sink ``sinks`` gives for it, e.g. a stock engine's ZMQ stream that a relay carries)."""
    admin = AdminClient(
        client_logging({**(kafka or {}), "bootstrap.servers": bootstrap, "log_level": 4})
    )
    ensure_topic(admin, topic, partitions, timeout=STARTUP_TIMEOUT_S)
    warn_under_replicated(bootstrap, kafka, [topic])
    publishers: list[KVEventPublisher] = []  # a restarted engine has had two

    def sink(instance_id: str) -> EventSink:
        if sinks is not None and instance_id in sinks:
            return sinks[instance_id]
        publisher = KVEventPublisher(
            PublisherConfig(
                bootstrap_servers=bootstrap,
                source_id=instance_id,
                model=fleet.model,
                topic=topic,
                kafka=dict(kafka or {}),
            ),
            codec=codec,
        )
        publishers.append(publisher)
        return publisher

    start = time.perf_counter()
    summary = Fleet(fleet, sink).run(Progress("publishing") if show_progress else None, rate)
    for publisher in publishers:
        # The simulated engines go on running: the publishing process leaves without a goodbye.
        publisher.close(timeout=60, goodbye=False)
    seconds = time.perf_counter() - start
    by_type: dict[str, int] = {}
    for publisher in publishers:
        for name, count in publisher.stats.by_type.items():
            by_type[name] = by_type.get(name, 0) + count
    return SimulationResult(
        summary=summary,
        produced=sum(p.stats.produced for p in publishers),
        acked=sum(p.stats.acked for p in publishers),
        by_type=by_type,
        seconds=seconds,
    )


def run(args: argparse.Namespace) -> int:
    fleet = FleetConfig(
        instances=args.instances,
        requests=args.requests,
        seed=args.seed,
        model=args.model,
        misconfigured_source=args.misconfigured_source,
        gpu_capacity_blocks=args.gpu_blocks,
    )
    result = run_simulation(
        settings.kafka_bootstrap(args),
        args.topic,
        fleet,
        args.partitions,
        rate=args.rate,
        kafka=settings.kafka_settings(args),
        codec=settings.codec(args, args.topic, writer=True),
    )
    s = result.summary
    print(f"instances:      {', '.join(s.instances)}")
    print(
        f"requests:       {s.requests} (lookup hits {s.lookup_hits} chunks, promotions "
        f"{s.promotions}, partial tails {s.partial_tails})"
    )
    print(
        f"messages:       {result.produced} produced, {result.acked} acknowledged "
        f"to topic {args.topic}"
    )
    for name, count in sorted(result.by_type.items()):
        print(f"  {name:<17}{count}")
    print(f"elapsed:        {result.seconds:.2f} s ({result.produced / result.seconds:,.0f} msg/s)")
    if args.prompt_out:
        Path(args.prompt_out).write_text(" ".join(map(str, s.last_prompt)) + "\n")
        print(f"prompt:         {len(s.last_prompt)} token ids in {args.prompt_out}")
    return 0
