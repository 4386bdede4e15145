"""Publisher configuration, read once at the edge and passed in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from confluent_kafka import KafkaException

from kvledger.producer.errors import BrokerUnreachableError
from kvledger.schemas.topics import DEFAULT_PARTITIONS, misconfigured, topic_limit

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
    ``reports_reuse``: the engine also announces the blocks a request reuses from its cache
    as stores (vLLM's ``kv_cache_report_mode="full"``), announced with each group: the index
    then takes a store of a block the engine already holds there as a report, not a copy.
    ``handoff_batches``: an embedded engine's batches (``publish_vllm_batch``, ``publish``)
    are handed to a background thread that writes them, at most this many waiting (a full
    queue blocks the caller); 0 writes them on the caller's thread. Transactional
    publishers (the relay) always write on the caller's thread.
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
    reports_reuse: bool = False
    handoff_batches: int = 1024
    # Set: every publish is inside a Kafka transaction the caller opens and commits (the
    # relay, which must publish each engine batch whole or not at all).
    transactional_id: str | None = None
    # At start-up the publisher asks the broker for the topic's size limit within this many
    # seconds and raises BrokerUnreachableError when none answers (0: skip the check; the
    # first failure then surfaces when deliveries time out).
    startup_timeout_s: float = 10.0
    # A topic missing at start-up is created with this many partitions, as `kvledger relay`
    # and `simulate` create it (0: not created; needs the check above).
    create_partitions: int = DEFAULT_PARTITIONS
    # The vLLM release whose offloading events the publisher's tracker turns into events:
    # its rules (0.33's or 0.34's; another is refused when the publisher is made).
    vllm_version: str = "0.33.0"

    def producer_settings(self) -> dict[str, object]:
        settings = dict(PRODUCER_DEFAULTS)
        settings.update(self.kafka)
        settings["bootstrap.servers"] = self.bootstrap_servers
        settings.setdefault("client.id", f"kvledger-{self.source_id}")
        if self.transactional_id is not None:
            settings["transactional.id"] = self.transactional_id
        return settings

    def sized_settings(self) -> dict[str, object]:
        """The producer's settings with batches and single messages sized to what the topic
        takes (asked of the broker unless ``startup_timeout_s`` is 0): a message too large is
        then refused when produced (no sequence number spent, the rest of the call goes on),
        and no batch of good messages is refused whole by the broker. Raises
        :class:`BrokerUnreachableError` when no broker answers in time."""
        settings = self.producer_settings()
        timeout = self.startup_timeout_s
        if timeout <= 0:
            return settings
        try:
            limit = topic_limit(settings, self.topic, timeout, create=self.create_partitions)
        except KafkaException as exc:
            if misconfigured(exc):
                raise  # a setting the client refuses: no broker would change that
            raise BrokerUnreachableError(
                f"no Kafka broker at {self.bootstrap_servers} answered within {timeout:.0f} s "
                f"({exc.args[0] if exc.args else exc})"
            ) from exc
        for name in ("message.max.bytes", "batch.size"):
            settings[name] = min(int(str(settings.get(name, 1_000_000))), limit)
        return settings
