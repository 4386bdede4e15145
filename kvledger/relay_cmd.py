"""`kvledger relay`: one stock vLLM or SGLang engine's ZMQ KV events, or a TensorRT-LLM
engine's polled ones, into Kafka (a sidecar)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from confluent_kafka.admin import AdminClient
from prometheus_client import start_http_server

from kvledger import settings
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.metrics import RelayMetrics
from kvledger.producer.relay.relay import Relay
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.replication import warn_under_replicated
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, ensure_topic

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    bootstrap = settings.kafka_bootstrap(args)
    kafka = settings.kafka_settings(args)
    config = _config(args, bootstrap, kafka)
    stopping = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    # Before anything waits on the broker: a signal stops the relay at any moment.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if not _topic_checked(args, bootstrap, kafka, stopping):
        logger.info("stopped before relaying")
        return 0
    metrics = RelayMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    relay = Relay(config, metrics)
    relay.start()
    logger.info(
        "relaying %s (%d rank(s)) from %s to %s on %s",
        args.source,
        args.dp_size,
        args.endpoint,
        args.topic,
        bootstrap,
    )
    while not stopping.wait(0.5):
        if not relay.alive():
            break
    relay.stop()
    if relay.errors:
        logger.error("relay stopped on an error: %s", relay.errors[0])
        return 1
    return 0


def _config(args: argparse.Namespace, bootstrap: str, kafka: dict[str, str]) -> RelayConfig:
    """The relay's configuration, every part checked before anything starts."""
    try:
        groups = [parse_group(g, args.model) for g in args.group]
    except ValueError as exc:
        raise SystemExit(f"kvledger relay: {exc}") from None
    if args.dp_size < 1:
        raise SystemExit("kvledger relay: --dp-size must be at least 1")
    survivors = (
        tuple(m.strip() for m in args.surviving_media.split(","))
        if (args.surviving_media)
        else None
    )
    try:
        return RelayConfig(
            endpoint=args.endpoint,
            replay_endpoint=args.replay_endpoint,
            source=args.source,
            model=args.model,
            bootstrap_servers=bootstrap,
            dp_size=args.dp_size,
            groups=groups,
            topic=args.topic,
            engine_topic=args.engine_topic.encode(),
            heartbeat_interval_s=args.heartbeat_interval,
            surviving_media=survivors,
            reports_reuse=args.report_mode == "full",
            engine=args.engine,
            poll_interval_s=args.poll_interval,
            health_url=args.health_url,
            engine_metrics_url=args.engine_metrics_url,
            kafka=dict(kafka),
            codec=settings.codec(args, args.topic, writer=True),
        )
    except ValueError as exc:
        raise SystemExit(f"kvledger relay: {exc}") from None


def _topic_checked(
    args: argparse.Namespace, bootstrap: str, kafka: dict[str, str], stopping: threading.Event
) -> bool:
    """Make the topic if it is missing (a broker that does not answer yet is the relay's to
    wait for); False when a signal came first."""

    def check_topic() -> None:
        try:
            admin = AdminClient(
                client_logging({**kafka, "bootstrap.servers": bootstrap, "log_level": 3})
            )
            # Any existing partition count does: keys keep each stream on one partition.
            ensure_topic(
                admin,
                args.topic,
                args.partitions,
                exact_partitions=False,
                timeout=STARTUP_TIMEOUT_S,
            )
            warn_under_replicated(bootstrap, kafka, [args.topic])
        except Exception as exc:  # the relay waits for the broker itself
            logger.warning(
                "could not check topic %s yet (%s); relaying once the broker answers",
                args.topic,
                exc,
            )

    # In a thread: the client's wait does not let the signal handler run until it ends.
    checker = threading.Thread(target=check_topic, name="kvledger-topic-check", daemon=True)
    checker.start()
    while checker.is_alive() and not stopping.wait(0.1):
        pass
    return not stopping.is_set()
