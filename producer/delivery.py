"""What became of a publisher's messages: counts, failed deliveries, messages refused as too
large, a fatal producer error; the errors a publisher raises for them; and the handing of
each message to the Kafka client (waiting while its queue is full, never dropping)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kvledger.producer.errors import (
    DeliveryError,
    FatalProducerError,
    MessageTooLargeError,
    PublishError,
)
from kvledger.schemas.topics import TOO_LARGE

logger = logging.getLogger(__name__)

_MAX_ERRORS_KEPT = 20
# Failures that are an abort's doing: the messages of an aborted transaction, dropped from
# the client's queue or in flight (the relay replays them from the engine).
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})


@dataclass
class PublisherStats:
    """Counters of one publisher (messages, not blocks)."""

    produced: int = 0  # produced and acked: set when read (KVEventPublisher.stats)
    acked: int = 0
    failed: int = 0
    retries_on_full_queue: int = 0
    by_type: dict[str, int] = field(default_factory=dict)


class Deliveries:
    """One publisher's delivery reports, fed by the Kafka client's callbacks."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.stats = PublisherStats()
        self.fatal: KafkaError | None = None
        self.refused: list[str] = []  # refused as too large during the current call
        self._errors: list[str] = []
        self._forgotten = 0  # produced in aborted transactions and failed there

    def send(
        self, producer: Producer, key: bytes, value: bytes, kind: str, healthy: Callable[[], None]
    ) -> bool:
        """Produce one message to the topic; while the client's queue is full, wait for the
        broker (backpressure: ``healthy`` raises if the publisher cannot go on). False when
        the topic refuses it as too large (said by :meth:`raise_refused`)."""
        topic = self.topic
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:
                self.stats.retries_on_full_queue += 1
                producer.poll(0.05)
                healthy()
            except KafkaException as exc:
                if exc.args and exc.args[0].code() in TOO_LARGE:
                    self.refused.append(f"{kind} of {len(value)} bytes")
                    logger.error(
                        "%s of %d bytes is larger than %s takes: not produced",
                        kind,
                        len(value),
                        topic,
                    )
                    return False
                raise PublishError(f"could not produce to {topic}: {exc}") from exc
        self.produced(kind)
        return True

    def counted(self, queued: int) -> PublisherStats:
        """The counters: ``produced`` as the count by type says (the only count kept while
        publishing), ``acked`` as produced less failed less the ``queued`` (librdkafka
        reports failures only; exact once flushed)."""
        stats = self.stats
        stats.produced = sum(stats.by_type.values()) - self._forgotten
        stats.acked = max(0, stats.produced - stats.failed - queued)
        return stats

    def produced(self, event_type: str) -> None:
        self.stats.by_type[event_type] = self.stats.by_type.get(event_type, 0) + 1

    def on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:  # reported where delivery.report.only.error is off
            return
        self.stats.failed += 1
        if len(self._errors) < _MAX_ERRORS_KEPT:
            self._errors.append(f"{err.name()}: {err.str()} (key {msg.key()!r})")
        if err.code() in _PURGED:  # an aborted transaction's: its owner says what follows
            logger.debug("delivery purged: %s", err)
        else:
            logger.error("delivery failed: %s", err)

    def on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.fatal = err
            logger.error("fatal Kafka producer error: %s", err)
        else:
            logger.warning("Kafka producer: %s", err)

    def forget_failures(self) -> None:
        """An aborted transaction's failures belong to it, not to what comes next: the
        messages it failed count as neither produced nor failed (nor acknowledged)."""
        self._forgotten += self.stats.failed
        self.stats.failed = 0
        self._errors.clear()

    def raise_refused(self) -> None:
        if self.refused:
            refused, self.refused = self.refused, []
            raise MessageTooLargeError(
                f"{len(refused)} event(s) larger than topic {self.topic} takes were not "
                f"produced (the others were): {'; '.join(refused[:3])}",
                refused,
            )

    def raise_fatal(self) -> None:
        if self.fatal is not None:
            raise FatalProducerError(f"fatal producer error: {self.fatal}")

    def raise_failures(self) -> None:
        if self.stats.failed:
            raise DeliveryError(
                f"{self.stats.failed} message(s) were not delivered to "
                f"{self.topic}: {'; '.join(self._errors[:3])}",
                list(self._errors),
            )
