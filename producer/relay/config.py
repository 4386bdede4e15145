"""A relay's configuration: the engine it listens to, the source it writes as, the groups it
announces (``--group IDX:KIND:BLOCK_SIZE[:HASH_BLOCK_SIZE]``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvledger.schemas.codec import Codec
from kvledger.schemas.events import GroupSpec

# The engines whose ZMQ stream a relay reads (producer/relay/wire.py, sglang.py).
ENGINES = ("vllm", "sglang", "trtllm")
# What a ZMQ socket connects to: tcp://HOST:PORT (HOST a name, an address or [IPv6]),
# ipc://PATH, inproc://NAME.
ZMQ_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):\d{1,5}|(ipc|inproc)://\S+)$")


@dataclass(frozen=True)
class RelayConfig:
    """One engine's relay. ``source``: the engine's source id (with ``dp_size`` > 1 each
    rank is ``<source>-dp<rank>``); ``groups``: the group specs to announce; ``engine``:
    vLLM's or SGLang's payloads (the framing and replay are the same) or TensorRT-LLM's
    HTTP endpoint, polled every ``poll_interval_s``."""

    endpoint: str
    source: str
    model: str
    bootstrap_servers: str
    replay_endpoint: str | None = None
    dp_size: int = 1
    groups: Sequence[GroupSpec] = ()
    topic: str = "kv-events"
    engine_topic: bytes = b""
    kafka: dict[str, object] = field(default_factory=dict)
    commit_interval_s: float = 0.1
    commit_batches: int = 2000
    heartbeat_interval_s: float = 5.0
    # Confluent Schema Registry framing (a Codec with a registry and a subject); else the
    # single-object framing.
    codec: Codec | None = None
    replay_timeout_ms: int = 2000
    receive_hwm: int = 10_000
    queue_kbytes: int = 65_536  # the producer's local queue: memory stays bounded
    surviving_media: tuple[str, ...] | None = None
    # The engine re-announces reused blocks as stores (vLLM's kv_cache_report_mode="full"),
    # said in each group's announcement: so it needs groups to announce.
    reports_reuse: bool = False
    engine: str = "vllm"  # whose wire the payloads are: ENGINES
    poll_interval_s: float = 0.2  # trtllm: seconds between polls of its HTTP endpoint
    # The engine's HTTP health route (vLLM's /health): the relay says the engine is there
    # (its start-up resync, a new life, heartbeats) only once this answers 200.
    health_url: str | None = None
    health_timeout_s: float = 1.0
    # The engine's Prometheus route (vLLM's /metrics): its requests running and queued are
    # read every heartbeat interval and sent in a heartbeat each interval, busy or idle
    # (producer/relay/load.py).
    engine_metrics_url: str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.engine == "trtllm" and (self.dp_size != 1 or self.replay_endpoint):
            raise ValueError(
                "a TensorRT-LLM engine is one HTTP endpoint (its attention-DP ranks are in its "
                "events) with no replay: no --dp-size, no --replay-endpoint"
            )
        if self.reports_reuse and not self.groups:
            raise ValueError(
                "the full report mode is announced with each group the relay announces: "
                "give the engine's groups with --group"
            )
        if self.engine == "trtllm" and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"a TensorRT-LLM endpoint is http(s)://HOST:PORT, not {self.endpoint!r}"
            )
        if self.health_url is not None and not self.health_url.startswith(("http://", "https://")):
            raise ValueError(f"--health-url {self.health_url!r}: expected http(s)://HOST:PORT/PATH")
        self._check_engine_metrics()
        if self.engine != "trtllm":
            for flag, endpoint in (
                ("--endpoint", self.endpoint),
                ("--replay-endpoint", self.replay_endpoint),
            ):
                if endpoint is not None and not ZMQ_ENDPOINT.match(endpoint):
                    raise ValueError(
                        f"{flag} {endpoint!r}: a {self.engine} engine's ZMQ endpoint is "
                        "tcp://HOST:PORT (or ipc://PATH, inproc://NAME)"
                    )

    def _check_engine_metrics(self) -> None:
        if self.engine_metrics_url is None:
            return
        if self.engine != "vllm":
            raise ValueError(
                "--engine-metrics-url: the load is read from vLLM's metrics; "
                f"a {self.engine} engine's are not read"
            )
        if not self.engine_metrics_url.startswith(("http://", "https://")):
            url = self.engine_metrics_url
            raise ValueError(f"--engine-metrics-url {url!r}: expected http(s)://HOST:PORT/PATH")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(
                "--engine-metrics-url: the load travels in heartbeats; give "
                "--heartbeat-interval above 0"
            )

    def rank_source(self, rank: int) -> str:
        return self.source if self.dp_size == 1 else f"{self.source}-dp{rank}"


def parse_group(text: str, model: str) -> GroupSpec:
    """``IDX:KIND:BLOCK_SIZE[:HASH_BLOCK_SIZE]`` as a group spec."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"--group {text!r}: expected IDX:KIND:BLOCK_SIZE[:HASH_BLOCK_SIZE]")
    try:
        idx, size = int(parts[0]), int(parts[2])
        hash_size = int(parts[3]) if len(parts) == 4 else size
    except ValueError:
        raise ValueError(f"--group {text!r}: IDX and sizes must be integers") from None
    spec = GroupSpec(model, idx, parts[1], size, hash_size)
    # Refused now, not once per event in the dead-letter topic.
    if idx < 0:
        raise ValueError(f"--group {text!r}: IDX must not be negative")
    if (problem := spec.shape_problem()) is not None:
        raise ValueError(f"--group {text!r}: {problem}")
    return spec
