"""Publisher configuration, read once at the edge and passed in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

HashFormat = Literal["int64", "digest"]

DEFAULT_TOPIC = "kv-events"

# No-loss settings; extra settings given by the user override these.
PRODUCER_DEFAULTS: Mapping[str, object] = MappingProxyType(
    {
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "lz4",
        "linger.ms": 20,
        "batch.num.messages": 10000,
        "queue.buffering.max.messages": 200000,
        "message.timeout.ms": 120000,
    }
)


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Where and as whom a publisher writes.

    ``hash_format``: ``"int64"`` publishes the digest's last 8 bytes (vLLM's default wire
    form), ``"digest"`` the whole digest. ``kafka`` holds extra librdkafka settings.
    ``heartbeat_interval_s``: a Heartbeat after this long without a message (0: never).
    ``surviving_media``: the media whose blocks outlive a restart of this engine, announced
    with each group (None: the contract's default, STORAGE only).
    """

    bootstrap_servers: str
    source_id: str
    model: str
    topic: str = DEFAULT_TOPIC
    dp_rank: int = 0
    hash_format: HashFormat = "int64"
    kafka: Mapping[str, object] = field(default_factory=dict)
    heartbeat_interval_s: float = 5.0
    surviving_media: tuple[str, ...] | None = None
    # Set: every publish is inside a Kafka transaction the caller opens and commits (the
    # relay, which must publish each engine batch whole or not at all).
    transactional_id: str | None = None
    # At start-up the publisher asks the broker for the topic's size limit within this many
    # seconds and raises BrokerUnreachableError when none answers (0: skip the check; the
    # first failure then surfaces when deliveries time out).
    startup_timeout_s: float = 10.0

    def producer_settings(self) -> dict[str, object]:
        settings = dict(PRODUCER_DEFAULTS)
        settings.update(self.kafka)
        settings["bootstrap.servers"] = self.bootstrap_servers
        settings.setdefault("client.id", f"kvledger-{self.source_id}")
        if self.transactional_id is not None:
            settings["transactional.id"] = self.transactional_id
        return settings
