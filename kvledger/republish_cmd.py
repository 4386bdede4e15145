"""`kvledger republish`: the index's events, per source, on vLLM's ZMQ sockets
(serving/republish/; its arguments: kvledger.arguments)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from kvledger import settings
from kvledger.consumer.db import connect
from kvledger.schemas.replication import warn_under_replicated_later
from kvledger.serving.republish.publisher import Endpoint, Publisher
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.match import DEFAULT_SILENT_AFTER

logger = logging.getLogger(__name__)


def parse_source(text: str, host: str) -> Endpoint:
    """``NAME=PORT[:REPLAY_PORT]`` as the endpoints it binds on ``host``."""
    name, sep, ports = text.rpartition("=")
    pub, _, replay = ports.partition(":")
    try:
        numbers = [int(p) for p in (pub, replay) if p]
    except ValueError:
        numbers = []
    if not sep or not name or not numbers or not all(0 < n < 65536 for n in numbers):
        raise ValueError(f"--source {text!r}: give NAME=PORT or NAME=PORT:REPLAY_PORT")
    address = f"tcp://{host}:"
    return Endpoint(
        name, address + str(numbers[0]), address + str(numbers[1]) if len(numbers) > 1 else None
    )


def run(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from kvledger.consumer.metrics import REGISTRY

    try:
        endpoints = [parse_source(s, args.host) for s in args.source]
    except ValueError as exc:
        raise SystemExit(f"kvledger republish: {exc}") from None
    if not endpoints and args.mux_port is None:
        raise SystemExit("kvledger republish: give --source NAME=PORT[:REPLAY_PORT] or --mux-port")
    names = [e.source for e in endpoints]
    if len(set(names)) < len(names):
        raise SystemExit("kvledger republish: a source is named twice")
    stopping = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    window = args.silent_after or DEFAULT_SILENT_AFTER.total_seconds()
    router = RouterIndex(
        settings.kafka_bootstrap(args),
        args.topic,
        args.consumer_group,
        kafka=dict(settings.kafka_settings(args)),
        codec=settings.codec(args, args.topic, writer=False),
        block_retention=args.block_retention,
    )
    warn_under_replicated_later(
        settings.kafka_bootstrap(args), settings.kafka_settings(args), [args.topic]
    )
    with connect(settings.lookup_database_url(args.database_url)) as conn:
        router.bootstrap(conn)
    mux = f"tcp://{args.host}:{args.mux_port}" if args.mux_port is not None else None
    publisher = Publisher(
        router,
        endpoints,
        mux,
        silent_after_s=window,
        topic=args.zmq_topic,
        buffer_steps=args.buffer_steps,
    )
    try:
        publisher.start()
    except Exception as exc:  # an address in use, or one no socket can bind
        raise SystemExit(f"kvledger republish: cannot bind its sockets: {exc}") from None
    router.start()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=REGISTRY)
    for e in endpoints:
        logger.info("republishing %s on %s (replay: %s)", e.source, e.pub, e.replay or "none")
    if mux is not None:
        logger.info("republishing every source on %s (topics kv@<source>@<model>)", mux)
    try:
        while not stopping.wait(0.5):
            problem = publisher.error or router.position().error
            if problem is not None:
                logger.error("republish stopped: %s", problem)
                return 1
    finally:
        publisher.stop()
        router.stop()
    return 0
