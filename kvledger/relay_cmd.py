"""`kvledger relay`: one stock vLLM engine's ZMQ KV events into Kafka (a sidecar)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from confluent_kafka.admin import AdminClient
from prometheus_client import start_http_server

from kvledger import settings
from kvledger.producer.config import DEFAULT_TOPIC
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.metrics import RelayMetrics
from kvledger.producer.relay.relay import Relay
from kvledger.schemas.topics import DEFAULT_PARTITIONS, ensure_topic

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "relay",
        help="relay a stock vLLM engine's ZMQ KV events into Kafka",
        description=(
            "Subscribe to a vLLM engine's KV-event publisher (started with --kv-events-config "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
            '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\') and publish its events '
            "to Kafka, recovering missed batches from the engine's replay socket. One relay "
            "per engine; data-parallel ranks listen on consecutive ports."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--endpoint", required=True, help="the engine's PUB endpoint, tcp://HOST:PORT")
    p.add_argument(
        "--replay-endpoint",
        help="the engine's replay (ROUTER) endpoint; without it gaps cannot be recovered",
    )
    p.add_argument("--source", required=True, help="the engine's source id in the index")
    p.add_argument("--model", required=True, help="the model the engine serves")
    p.add_argument(
        "--dp-size", type=int, default=1,
        help="data-parallel ranks: rank r listens on the endpoints' ports + r and is source "
        "<source>-dp<r>",
    )  # fmt: skip
    p.add_argument(
        "--group", action="append", default=[], metavar="IDX:KIND:BLOCK_SIZE[:HASH_BLOCK_SIZE]",
        help="a KV-cache group's spec to announce (repeat per group); groups without one "
        "need an operator's `kvledger groups declare`",
    )  # fmt: skip
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the Kafka topic")
    p.add_argument("--engine-topic", default="", help="the engine's ZMQ topic (vLLM's `topic`)")
    p.add_argument("--bootstrap", help=f"Kafka bootstrap servers (env {settings.ENV_KAFKA})")
    settings.add_kafka_args(p)
    settings.add_registry_args(p)
    p.add_argument(
        "--partitions", type=int, default=DEFAULT_PARTITIONS,
        help="partitions when the relay creates the topic",
    )  # fmt: skip
    p.add_argument(
        "--surviving-media", default=None,
        help="comma-separated media whose blocks outlive an engine restart (default STORAGE)",
    )  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="interface for /metrics")
    p.add_argument(
        "--heartbeat-interval", type=float, default=5.0,
        help="seconds of engine silence before probing it and sending a heartbeat (0: never)",
    )  # fmt: skip
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    bootstrap = settings.kafka_bootstrap(args)
    kafka = settings.kafka_settings(args)
    try:
        groups = [parse_group(g, args.model) for g in args.group]
    except ValueError as exc:
        raise SystemExit(f"kvledger relay: {exc}") from None
    if args.dp_size < 1:
        raise SystemExit("kvledger relay: --dp-size must be at least 1")
    survivors = tuple(m.strip() for m in args.surviving_media.split(",")) if (
        args.surviving_media
    ) else None  # fmt: skip
    config = RelayConfig(
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
        kafka=dict(kafka),
        codec=settings.codec(args, args.topic, writer=True),
    )
    try:
        admin = AdminClient({**kafka, "bootstrap.servers": bootstrap, "log_level": 3})
        # Any existing partition count does: keys keep each stream on one partition.
        ensure_topic(admin, args.topic, args.partitions, exact_partitions=False)
    except Exception as exc:  # the relay waits for the broker itself
        logger.warning("could not check topic %s yet: %s", args.topic, exc)
    metrics = RelayMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    relay = Relay(config, metrics)
    stopping = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    relay.start()
    logger.info(
        "relaying %s (%d rank(s)) from %s to %s on %s",
        args.source, args.dp_size, args.endpoint, args.topic, bootstrap,
    )  # fmt: skip
    while not stopping.wait(0.5):
        if not relay.alive():
            break
    relay.stop()
    if relay.errors:
        logger.error("relay stopped on an error: %s", relay.errors[0])
        return 1
    return 0
