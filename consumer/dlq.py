"""The dead-letter path: rejected messages to a Kafka topic, with their coordinates and reason.

The rejected_events table is the source of truth (written in the batch's transaction); the
topic is produced and flushed before that transaction commits, so every rejection reaches it
at least once (a crash between the flush and the commit can repeat one).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from kvledger.consumer.core.model import Rejection
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.topics import ensure_topic

logger = logging.getLogger(__name__)

DLQ_PARTITIONS = 3


class DeadLetterError(KvledgerError):
    """The dead-letter topic did not acknowledge; the batch is retried, nothing is lost."""


class DeadLetterProducer:
    def __init__(self, bootstrap: str, topic: str, timeout: float = 30.0) -> None:
        self.topic = topic
        self.timeout = timeout
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "client.id": "kvledger-dlq",
            }
        )
        self._errors: list[str] = []
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
        ensure_topic(admin, topic, DLQ_PARTITIONS, timeout=timeout, exact_partitions=False)

    def send(self, rejections: Sequence[Rejection]) -> None:
        """Produce every rejection and wait for the acknowledgements (raises on failure)."""
        if not rejections:
            return
        self._errors.clear()
        for r in rejections:
            m = r.message
            headers: list[tuple[str, str | bytes | None]] = [
                ("kvledger.topic", m.topic.encode()),
                ("kvledger.partition", str(m.partition).encode()),
                ("kvledger.offset", str(m.offset).encode()),
                ("kvledger.reason", r.reason.encode()),
                ("kvledger.detail", r.detail[:1000].encode()),
            ]
            while True:
                try:
                    self._producer.produce(
                        self.topic,
                        value=m.value,
                        key=m.key,
                        headers=headers,
                        on_delivery=self._on_delivery,
                    )
                    break
                except BufferError:
                    self._producer.poll(0.05)
        remaining = self._producer.flush(self.timeout)
        if remaining or self._errors:
            raise DeadLetterError(
                f"dead-letter topic {self.topic}: {remaining} unacknowledged, errors "
                f"{self._errors[:3]}"
            )

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._errors.append(str(err))

    def close(self) -> None:
        self._producer.flush(self.timeout)
