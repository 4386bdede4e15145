"""`kvledger replay`'s arguments (its code: kvledger.replay_cmd)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.options import add_kafka_args, bootstrap_arg
from kvledger.parsers import COUNT, SECONDS, add, bounded, command
from kvledger.replay import POLICIES as POLICY_NAMES

if TYPE_CHECKING:
    from kvledger.parsers import Subparsers


def _policies(text: str) -> tuple[str, ...]:
    import argparse

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or '(none)'}: "
            f"choose from {', '.join(POLICY_NAMES)}"
        )
    return names


def add_replay(subparsers: Subparsers) -> None:
    p = add(
        subparsers,
        "replay",
        "",
        "replay a request trace through fleets of simulated engines, every router policy "
        "side by side",
        description=(
            "Read a trace of Mooncake's shape: JSON lines of timestamp (ms), input_length, "
            "output_length and hash_ids (one id per block of --block-tokens prompt tokens). "
            "Check it whole, then replay it against one fleet of simulated vLLM engines per "
            "router policy, all on the same requests at the same instants. Each engine has a "
            "GPU prefix cache, a CPU offload tier and a prefill time model. The kvledger "
            "policies route from kvledger's router index, which learns from the engines' "
            "events through Kafka only. Writes fleet-<date>.json, .md and .png to --out."
        ),
    )
    p.add_argument(
        "trace", help="the trace file (e.g. ../shared/traces/mooncake-conversation.jsonl)"
    )
    p.add_argument("--engines", type=COUNT, default=10, help="simulated engines per fleet")
    p.add_argument(
        "--tokens-per-engine",
        type=COUNT,
        default=3_000_000,
        metavar="N",
        help="each engine's cache in tokens: its CPU tier (every block the GPU holds is "
        "offloaded there too)",
    )
    p.add_argument(
        "--gpu-share",
        type=bounded(float, 0.0, 1.0),
        default=1 / 6,
        metavar="F",
        help="the share of the cache the GPU keeps (the most recently used)",
    )
    p.add_argument(
        "--speed",
        type=bounded(float, 1.0, 60.0),
        default=10.0,
        help="how many times faster than the trace's own clock to replay (1 to 60)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=POLICY_NAMES,
        metavar="A,B",
        help=f"the policies to compare (default all: {', '.join(POLICY_NAMES)})",
    )
    p.add_argument("--requests", type=COUNT, metavar="N", help="the trace's first N requests only")
    p.add_argument("--block-tokens", type=COUNT, default=512, help="tokens per hash id")
    p.add_argument("--slo", type=SECONDS, default=5.0, help="the TTFT objective, in seconds")
    p.add_argument(
        "--out", default="bench/results", metavar="DIR", help="where the results are written"
    )
    p.add_argument("--name", metavar="STEM", help="the results' file name (default fleet-<date>)")
    bootstrap_arg(p)
    add_kafka_args(p)
    p.set_defaults(run=command("replay_cmd:run"))
