"""The dead-letter path: rejected messages to a Kafka topic, with their coordinates and reason.

The rejected_events table is the source of truth (written in the batch's transaction); the
topic is produced and flushed before that transaction commits, so every rejection reaches it
at least once (a crash between the flush and the commit can repeat one).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient

from kvledger.consumer.core.model import Rejection
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, TOO_LARGE, admin_settings, ensure_topic

logger = logging.getLogger(__name__)

DLQ_PARTITIONS = 3


class DeadLetterError(KvledgerError):
    """The dead-letter topic did not acknowledge; the batch is retried, nothing is lost."""


@dataclass(frozen=True)
class DeadLetterTopic:
    """The dead-letter topic: its name, and how it is created: with the cluster's default
    replication factor (``replication_factor=-1``) and ``config`` (e.g.
    ``min.insync.replicas``), so a cluster that requires more than one replica works.
    ``derived``: the topic is the events topic's own (``<topic>.dlq``, not named by the
    user): where the shared one of earlier releases exists, that is said."""

    name: str
    replication_factor: int = -1
    config: Mapping[str, str] = field(default_factory=dict)
    derived: bool = False


class DeadLetterProducer:
    """Produces rejections to the dead-letter topic and waits for every acknowledgement.

    A rejection too large for the topic (the broker's or the client's size limit: the headers
    add to the original bytes) is sent as a truncated record instead, an empty value with a
    ``kvledger.truncated`` header giving the original size: its whole bytes are in
    kvledger.rejected_events either way, and the consumer never stalls on it. The topic is
    created as :class:`DeadLetterTopic` says.
    """

    def __init__(
        self,
        bootstrap: str,
        dead_letters: DeadLetterTopic,
        timeout: float = 30.0,
        settings: Mapping[str, object] | None = None,
    ) -> None:
        topic = self.topic = dead_letters.name
        self.timeout = timeout
        producer_settings: dict[str, object] = {
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "client.id": "kvledger-dlq",
            **(settings or {}),
            "bootstrap.servers": bootstrap,
        }
        self._producer = Producer(client_logging(producer_settings))
        self._failed: dict[int, KafkaError] = {}
        admin = AdminClient(
            client_logging(
                {**admin_settings(settings or {}), "bootstrap.servers": bootstrap, "log_level": 4}
            )
        )
        ensure_topic(
            admin,
            topic,
            DLQ_PARTITIONS,
            timeout=min(timeout, STARTUP_TIMEOUT_S),
            exact_partitions=False,
            replication_factor=dead_letters.replication_factor,
            config=dict(dead_letters.config),
        )
        self.truncated = 0
        # A topic's own dead-letter topic (not named by the user): earlier rejections may be
        # in the one every topic shared before.
        self.earlier = earlier_dead_letters(admin, topic) if dead_letters.derived else None
        if self.earlier is not None:
            logger.warning(
                "dead letters now go to %s; before kvledger 0.3 every topic's went to %s, "
                "which holds earlier ones (each is in kvledger.rejected_events too; "
                "--dlq-topic %s keeps using it)",
                topic,
                self.earlier,
                self.earlier,
            )

    def send(self, rejections: Sequence[Rejection]) -> None:
        """Produce every rejection and wait for the acknowledgements (raises on failure)."""
        if not rejections:
            return
        self._failed.clear()
        too_large: list[int] = []
        for i, r in enumerate(rejections):
            if not self._produce(i, r, truncated=False):
                too_large.append(i)
        remaining = self._producer.flush(self.timeout)
        too_large += [i for i, err in self._failed.items() if err.code() in TOO_LARGE]
        errors = [str(err) for err in self._failed.values() if err.code() not in TOO_LARGE]
        if too_large and not remaining and not errors:
            self._failed.clear()
            for i in too_large:
                self._produce(i, rejections[i], truncated=True)
                self.truncated += 1
                logger.warning(
                    "rejection %s[%d]@%d (%d bytes) is too large for %s: sent truncated",
                    rejections[i].message.topic,
                    rejections[i].message.partition,
                    rejections[i].message.offset,
                    len(rejections[i].message.value),
                    self.topic,
                )
            remaining = self._producer.flush(self.timeout)
            errors = [str(err) for err in self._failed.values()]
        if remaining or errors:
            raise DeadLetterError(
                f"dead-letter topic {self.topic}: {remaining} unacknowledged, errors {errors[:3]}"
            )

    def _produce(self, index: int, r: Rejection, truncated: bool) -> bool:
        """Queue one record; False when the client refuses it as too large."""
        m = r.message
        headers: list[tuple[str, str | bytes | None]] = [
            ("kvledger.topic", m.topic.encode()),
            ("kvledger.partition", str(m.partition).encode()),
            ("kvledger.offset", str(m.offset).encode()),
            ("kvledger.reason", r.reason.encode()),
            ("kvledger.detail", r.detail[:1000].encode()),
        ]
        if truncated:
            headers.append(("kvledger.truncated", str(len(m.value)).encode()))
        value = b"" if truncated else m.value
        key = m.key[:256] if truncated and m.key is not None else m.key

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                self._failed[index] = err

        while True:
            try:
                self._producer.produce(
                    self.topic, value=value, key=key, headers=headers, on_delivery=delivered
                )
                return True
            except BufferError:
                self._producer.poll(0.05)
            except KafkaException as exc:
                if not truncated and exc.args[0].code() in TOO_LARGE:
                    return False
                raise DeadLetterError(f"dead-letter topic {self.topic}: {exc}") from exc

    def close(self) -> None:
        self._producer.flush(self.timeout)


# Before kvledger 0.3 every topic's dead letters went to this one.
SHARED_DLQ = "kv-events.dlq"


def earlier_dead_letters(admin: AdminClient, topic: str) -> str | None:
    """The shared dead-letter topic of earlier releases, when ``topic`` is another and that
    one exists (it may hold this topic's earlier rejections); else None."""
    if topic == SHARED_DLQ:
        return None
    try:
        listed = admin.list_topics(SHARED_DLQ, timeout=5).topics.get(SHARED_DLQ)
    except KafkaException:
        return None
    return SHARED_DLQ if listed is not None and listed.error is None else None
