"""The engine side's command's arguments: relay (its code: kvledger.relay_cmd)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.options import (
    DEFAULT_PARTITIONS,
    DEFAULT_TOPIC,
    ENGINES,
    add_kafka_args,
    add_registry_args,
    bootstrap_arg,
    metrics_args,
)
from kvledger.parsers import COUNT, SECONDS, SECONDS_OR_OFF, add, command

if TYPE_CHECKING:
    from kvledger.parsers import Subparsers


def add_relay(subparsers: Subparsers) -> None:
    p = add(
        subparsers,
        "relay",
        "relay",
        "relay a stock vLLM or SGLang engine's ZMQ KV events into Kafka",
        description=(
            "Subscribe to a vLLM engine's KV-event publisher (started with --kv-events-config "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
            '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'), or an SGLang engine\'s '
            "(--engine sglang; SGLang's --kv-events-config takes the same JSON), or poll a "
            "TensorRT-LLM server's events (--engine trtllm, --endpoint http://HOST:PORT), and "
            "publish its events to Kafka, recovering missed batches from the engine's replay "
            "socket where it has one. One relay per engine; data-parallel ranks listen on "
            "consecutive ports."
        ),
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="whose events: vLLM's or SGLang's ZMQ stream (the same framing and replay), or "
        "TensorRT-LLM's HTTP endpoint (trtllm-serve's POST /kv_cache_events, polled; no "
        "replay): docs/engines.md's table says how each is read",
    )
    p.add_argument(
        "--endpoint",
        required=True,
        help="the engine's PUB endpoint, tcp://HOST:PORT (trtllm: http://HOST:PORT)",
    )
    p.add_argument(
        "--poll-interval",
        type=SECONDS,
        default=0.2,
        help="trtllm: seconds between polls of the engine's events",
    )
    p.add_argument(
        "--replay-endpoint",
        help="the engine's replay (ROUTER) endpoint; without it gaps cannot be recovered",
    )
    p.add_argument("--source", required=True, help="the engine's source id in the index")
    p.add_argument("--model", required=True, help="the model the engine serves")
    p.add_argument(
        "--dp-size",
        type=COUNT,
        default=1,
        help="data-parallel ranks: rank r listens on the endpoints' ports + r and is source "
        "<source>-dp<r>",
    )
    p.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="IDX:KIND:BLOCK_SIZE[:HASH_BLOCK_SIZE]",
        help="a KV-cache group's spec to announce (repeat per group); groups without one "
        "need an operator's `kvledger groups declare`",
    )
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the Kafka topic")
    p.add_argument("--engine-topic", default="", help="the engine's ZMQ topic (vLLM's `topic`)")
    bootstrap_arg(p)
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument(
        "--partitions",
        type=COUNT,
        default=DEFAULT_PARTITIONS,
        help="partitions when the relay creates the topic",
    )
    p.add_argument(
        "--surviving-media",
        default=None,
        help="comma-separated media whose blocks outlive an engine restart (default STORAGE)",
    )
    p.add_argument(
        "--report-mode",
        choices=("incremental", "full"),
        default="incremental",
        help='full: the engine runs with vLLM\'s kv_cache_report_mode="full", so a store '
        "of a block it already holds is a reuse report, not a second copy (needs --group)",
    )
    metrics_args(p)
    p.add_argument(
        "--heartbeat-interval",
        type=SECONDS_OR_OFF,
        default=5.0,
        help="seconds of engine silence before probing it and sending a heartbeat (0: never)",
    )
    p.add_argument(
        "--health-url",
        default=None,
        metavar="URL",
        help="the engine's HTTP health route (vLLM: http://HOST:PORT/health): the engine is "
        "said to be there only once it answers 200 (without it, its replay socket decides)",
    )
    p.add_argument(
        "--engine-metrics-url",
        default=None,
        metavar="URL",
        help="the engine's Prometheus route (vLLM: http://HOST:PORT/metrics): its requests "
        "running and waiting go out in every heartbeat, for lookups of load (vLLM only)",
    )
    p.set_defaults(run=command("relay_cmd:run"))
