"""The live pipeline of a replay: the simulated engines' events into Kafka through kvledger's
producer library, as the vLLM plugin publishes an engine's (one :class:`KVEventPublisher`
per engine, its KV cache group announced), and kvledger's router index following the topic
(``serve --memory``'s :class:`RouterIndex`), from which the kvledger policies route.

Measured here: each message's lag from its log time to the end of the index's apply
(engine → router), and the index's distance to the log's end over the run (consumer lag).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kvledger.consumer.core.model import GroupKey
from kvledger.consumer.inbound import Inbound
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.replay.engines import CPU, GPU, Change, hash_key
from kvledger.schemas.events import BlockRemoved, BlockStored, GroupSpec, Heartbeat, KVEvent
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import ensure_topic, partition_offsets
from kvledger.serving.router.index import RouterIndex

logger = logging.getLogger(__name__)
GROUP = 0


@dataclass
class _Batch:
    """A KVEventBatch as vLLM hands it to a publisher."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class KafkaFleetSink:
    """A fleet's changes as vLLM's events (GPU and CPU stores and removals), each engine's
    published by its own producer."""

    def __init__(  # noqa: PLR0913 - where, then what: each set by name by pipeline users
        self,
        bootstrap: str,
        topic: str,
        model: str,
        names: Sequence[str],
        block_tokens: int,
        kafka: Mapping[str, object] | None = None,
    ) -> None:
        self.model, self.names, self.block_tokens = model, list(names), block_tokens
        self.filler = (0,) * block_tokens  # token ids: the index is asked by hash here
        self.publishers: list[KVEventPublisher] = []
        for name in names:
            publisher = KVEventPublisher(
                PublisherConfig(
                    bootstrap_servers=bootstrap,
                    source_id=name,
                    model=model,
                    topic=topic,
                    kafka=dict(kafka or {}),
                    create_partitions=0,
                    startup_timeout_s=0,
                )
            )
            self.publishers.append(publisher)
            spec = GroupSpec(model, GROUP, "full_attention", block_tokens, block_tokens)
            publisher.announce_group_spec(spec)
        self.batches = 0

    def changed(self, engine: int, changes: Sequence[Change]) -> None:
        events: list[KVEvent] = []
        for change in changes:
            hashes = tuple(hash_key(h) for h in change.ids)
            if change.stored:
                parent = hash_key(change.parent) if change.parent is not None else None
                events.append(
                    BlockStored(
                        hashes,
                        parent,
                        self.filler * len(hashes),
                        self.block_tokens,
                        None,
                        change.medium,
                        None,
                    )
                )
            else:
                events.append(BlockRemoved(hashes, change.medium))
        self.publishers[engine].publish_vllm_batch(_Batch(time.time(), events))
        self.batches += 1

    def report_load(self, engine: int, running: int, waiting: int) -> None:
        """The engine's load, as a relay that reads its engine's metrics says it."""
        self.publishers[engine].publish_events([Heartbeat(GROUP, 1000, running, waiting)])

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close(timeout=60, goodbye=False)


class TimedIndex(RouterIndex):
    """The router index, with each message's lag from its log time to its apply's end."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lags_ms: list[float] = []

    def apply(self, batch: Sequence[Inbound]) -> None:
        super().apply(batch)
        now_ms = time.time() * 1000
        self.lags_ms.extend(now_ms - m.timestamp_ms for m in batch if m.timestamp_ms)


@dataclass
class Pipeline:
    """The topic, the fleets' sinks on it and the index following it."""

    bootstrap: str
    topic: str
    kafka: dict[str, object] = field(default_factory=dict)
    partitions: int = 8
    index: TimedIndex | None = None
    sinks: list[KafkaFleetSink] = field(default_factory=list)
    behind: list[int] = field(default_factory=list)  # the index's lag, sampled

    def admin(self) -> AdminClient:
        return AdminClient(client_logging({**self.kafka, "bootstrap.servers": self.bootstrap}))

    def start(self) -> TimedIndex:
        ensure_topic(self.admin(), self.topic, self.partitions)
        settings = {str(k): v for k, v in self.kafka.items()}
        index = TimedIndex(
            self.bootstrap, self.topic, f"{self.topic}-index", kafka=settings, block_retention=None
        )
        index.start()
        self.index = index
        return index

    def fleet_sink(self, model: str, names: Sequence[str], block_tokens: int) -> KafkaFleetSink:
        sink = KafkaFleetSink(self.bootstrap, self.topic, model, names, block_tokens, self.kafka)
        self.sinks.append(sink)
        return sink

    def sample(self) -> None:
        if self.index is not None:
            self.behind.append(self.index.position().behind_messages)

    def drain(self, timeout: float = 120.0) -> None:
        """Every event published and applied by the index."""
        for sink in self.sinks:
            for publisher in sink.publishers:
                publisher.flush(timeout)
        ends = partition_offsets(self.admin(), self.topic)
        assert self.index is not None
        self.index.wait_for(ends, timeout)

    def held(self, model: str, names: Sequence[str]) -> dict[tuple[str, str], set[bytes]]:
        """What the index says each (engine, medium) holds of ``model``."""
        assert self.index is not None
        index = self.index
        out: dict[tuple[str, str], set[bytes]] = {
            (name, medium): set() for name in names for medium in (GPU, CPU)
        }
        with index.lock:
            group = index.store.groups.get(GroupKey(model, GROUP))
            if group is None:
                return out
            for hid, (instance, medium, _ownership) in enumerate(index.store.holders):
                if (instance, medium) in out:
                    out[(instance, medium)].update(group.held_by(hid))
        return out

    def stop(self, delete: bool = True) -> None:
        for sink in self.sinks:
            sink.close()
        if self.index is not None:
            self.index.stop()
        if delete:  # waited for: a process that leaves at once would never send it
            admin = self.admin()  # held: its futures die with it
            for future in admin.delete_topics([self.topic]).values():
                try:
                    future.result(timeout=30)
                except KafkaException as exc:
                    logger.warning("the replay's topic %s was not removed: %s", self.topic, exc)
