"""Where a relay stopped, read back from the topic (committed messages only).

Each group's messages go to one partition (key ``<source>/<group>``, librdkafka's
``consistent_random`` partitioner: CRC-32 of the key). For each group the relay knows, the
partition is read backwards in growing windows until the source's last message of that group
is found: it gives the epoch and the next sequence number; the last message that came from an
engine batch gives the engine's sequence number and the batch's time (which tells the same
engine incarnation from a new one).
"""

from __future__ import annotations

import logging
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import Envelope
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import message_key

logger = logging.getLogger(__name__)

PARTITIONER = "consistent_random"  # the relay's producers pin it: partition = CRC-32 % n
_FIRST_WINDOW = 512
_TIMEOUT_S = 30.0  # each of the reads of a partition


def partition_for(key: bytes, partitions: int) -> int:
    return zlib.crc32(key) % partitions


@dataclass
class StreamPosition:
    """A relayed source's position: its epoch, each group's next sequence number, and the
    last engine batch published (its number and time)."""

    epoch: int
    next_seqs: dict[int, int] = field(default_factory=dict)
    engine_seq: int | None = None
    engine_time_ms: int | None = None


@dataclass(frozen=True, slots=True)
class _Last:
    envelope: Envelope
    batch: Envelope | None  # the newest message of the epoch that carried an engine batch


def recover(
    settings: Mapping[str, object],
    topic: str,
    source: str,
    groups: Iterable[int],
    codec: Codec | None = None,
) -> StreamPosition | None:
    """The source's position on ``topic`` from its groups' last messages (None: nothing)."""
    consumer = Consumer(
        client_logging(
            {
                **settings,
                "group.id": f"kvledger-relay-recover-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
                "log_level": 3,
            }
        )
    )
    reader = _Reader(consumer, codec or Codec(), topic)
    try:
        meta = consumer.list_topics(topic, timeout=_TIMEOUT_S).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return None
        lasts = {}
        for group in sorted(set(groups)):
            key = message_key(source, group)
            last = reader.last_of(partition_for(key, len(meta.partitions)), key)
            if last is not None:
                lasts[group] = last
    finally:
        consumer.close()
    if not lasts:
        return None
    epoch = max(last.envelope.epoch for last in lasts.values())
    position = StreamPosition(epoch)
    for group, last in lasts.items():
        if last.envelope.epoch == epoch:
            position.next_seqs[group] = last.envelope.seq + 1
        batch = last.batch
        if (
            batch is not None
            and batch.epoch == epoch
            and batch.engine_seq is not None
            and (position.engine_seq is None or batch.engine_seq > position.engine_seq)
        ):
            position.engine_seq = batch.engine_seq
            position.engine_time_ms = batch.event_time_ms
    return position


@dataclass(frozen=True)
class _Reader:
    """One topic's partitions read backwards by a consumer of its own."""

    consumer: Consumer
    codec: Codec
    topic: str

    def last_of(self, partition: int, key: bytes) -> _Last | None:
        low, high = self.consumer.get_watermark_offsets(
            TopicPartition(self.topic, partition), timeout=_TIMEOUT_S
        )
        last: Envelope | None = None
        window = _FIRST_WINDOW
        end = high
        while end > low:
            start = max(low, end - window)
            found = [env for env in self.read(partition, (start, end), key) if env is not None]
            for env in reversed(found):
                if last is None:
                    last = env
                elif env.epoch != last.epoch:
                    return _Last(last, None)  # the epoch has no engine batch in this group
                if env.engine_seq is not None:
                    return _Last(last, env)
            end = start
            window *= 4
        return _Last(last, None) if last is not None else None

    def read(self, partition: int, offsets: tuple[int, int], key: bytes) -> list[Envelope | None]:
        """The envelopes of ``key`` at ``offsets`` [start, end), in order (undecodable:
        skipped)."""
        consumer, topic = self.consumer, self.topic
        start, end = offsets
        consumer.assign([TopicPartition(topic, partition, start)])
        out: list[Envelope | None] = []
        try:
            while True:
                msg = consumer.poll(_TIMEOUT_S)
                if msg is None:
                    raise KafkaException(
                        KafkaError(KafkaError._TIMED_OUT, f"reading {topic}[{partition}] stalled")
                    )
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        break
                    raise KafkaException(err)
                offset = msg.offset()
                if offset is not None and offset >= end:
                    break
                if msg.key() != key:
                    continue
                try:
                    out.append(self.codec.decode(msg.value() or b""))
                except DecodeError as exc:
                    logger.warning("skipping an undecodable message of %r: %s", key, exc)
        finally:
            consumer.assign([TopicPartition(topic, partition, OFFSET_END)])
            consumer.unassign()
        return out
