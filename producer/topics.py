"""Topic creation and verification."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from producer.errors import TopicMismatchError

logger = logging.getLogger(__name__)

DEFAULT_PARTITIONS = 12


def ensure_topic(
    admin: AdminClient,
    name: str,
    partitions: int = DEFAULT_PARTITIONS,
    retention_ms: int | None = None,
    replication_factor: int = 1,
    timeout: float = 30.0,
) -> bool:
    """Create ``name`` if missing; verify an existing one. Returns True when it was created.

    Raises :class:`TopicMismatchError` when the topic exists with another partition count or
    retention.
    """
    metadata = admin.list_topics(topic=name, timeout=timeout)
    topic = metadata.topics.get(name)
    exists = topic is not None and topic.error is None
    if not exists:
        config = {"retention.ms": str(retention_ms)} if retention_ms is not None else {}
        futures = admin.create_topics(
            [NewTopic(name, partitions, replication_factor, config=config)],
            operation_timeout=timeout,
        )
        try:
            futures[name].result(timeout=timeout)
            logger.info("created topic %s with %d partitions", name, partitions)
            return True
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        metadata = admin.list_topics(topic=name, timeout=timeout)
        topic = metadata.topics[name]
    assert topic is not None
    have = len(topic.partitions)
    if have != partitions:
        raise TopicMismatchError(
            f"topic {name!r} has {have} partitions, expected {partitions}; use the existing "
            "count or another topic (Kafka cannot shrink a topic)"
        )
    if retention_ms is not None:
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)
        configs = admin.describe_configs([resource])[resource].result(timeout=timeout)
        actual = configs["retention.ms"].value
        if actual != str(retention_ms):
            raise TopicMismatchError(
                f"topic {name!r} has retention.ms={actual}, expected {retention_ms}"
            )
    return False
