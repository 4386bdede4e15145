"""The topic layout both sides rely on: message keys, and topic creation and verification.

Every message of one (source, group) carries the key ``<source>/<group>``, so it lands on one
partition and stays in publish order. The events topic and the dead-letter topic are created
(or checked) by :func:`ensure_topic`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from kvledger.schemas.errors import NotAuthorizedError, TopicMismatchError
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.replication import default_replication

logger = logging.getLogger(__name__)

DEFAULT_PARTITIONS = 12
# How long a command waits at start for a broker to answer before it says none does.
STARTUP_TIMEOUT_S = 10.0


def message_key(source: str, group_idx: int) -> bytes:
    """The key of every message of one source's group."""
    return f"{source}/{group_idx}".encode()


def admin_settings(settings: Mapping[str, object]) -> dict[str, str | int | float | bool]:
    """Of a producer's or consumer's client settings, those an admin client takes too (the
    cluster's address and security, client ids, socket options): scalar values, without the
    settings only producers or only consumers know."""
    return {
        k: v
        for k, v in settings.items()
        if isinstance(v, str | int | float | bool) and not k.startswith(_ONE_KIND_ONLY)
    }


_ONE_KIND_ONLY = (
    # producers
    "enable.idempotence",
    "acks",
    "compression.",
    "linger.ms",
    "batch.",
    "queue.",
    "message.timeout.ms",
    "transactional.id",
    "transaction.timeout.ms",
    "partitioner",
    "message.max.bytes",
    "error_cb",
    # consumers
    "group.",
    "enable.auto.",
    "auto.offset.reset",
    "session.timeout.ms",
    "isolation.level",
    "queued.",
    "fetch.",
    "max.poll.interval.ms",
    "partition.assignment.strategy",
    "heartbeat.interval.ms",
    "enable.partition.eof",
)


# How long a topic kvledger creates keeps its records (Kafka's own default, stated on the
# topic so that it does not follow a broker's setting): a consumer or router away longer
# than this finds records it never read deleted (it says so; see docs/operations.md, "Retention").
DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000


def ensure_topic(  # noqa: PLR0913 - Kafka's topic settings, each with a default, set by name
    admin: AdminClient,
    name: str,
    partitions: int = DEFAULT_PARTITIONS,
    retention_ms: int | None = None,
    replication_factor: int | None = None,
    timeout: float = 30.0,
    exact_partitions: bool = True,
    log_append_time: bool = True,
    config: Mapping[str, str] | None = None,
) -> bool:
    """Create ``name`` if missing; verify an existing one. Returns True when it was created.

    Raises :class:`TopicMismatchError` when the topic exists with another retention, or with
    another partition count while ``exact_partitions`` (any count does for a topic whose
    order does not matter, such as the dead-letter topic). A topic it creates stamps each
    record with the broker's clock (``log_append_time``): the index's liveness clock.
    ``config``: more topic settings for a topic it creates (its retention is
    :data:`DEFAULT_RETENTION_MS` unless ``retention_ms`` or ``config`` says otherwise; an
    existing topic's is checked only against ``retention_ms``). ``replication_factor``:
    None (the default) gives a topic it creates ``min(3, brokers)`` replicas and, on three
    brokers or more, ``min.insync.replicas=2`` unless ``config`` sets it (one broker may be
    lost; see docs/operations.md, "A production cluster"); -1 takes the cluster's default;
    a number, that many.
    """
    try:
        wanted = _Wanted(
            partitions, retention_ms, replication_factor, exact_partitions, log_append_time, config
        )
        return _ensure_topic(admin, name, wanted, timeout)
    except KafkaException as exc:
        if refused(exc.args[0]):
            raise NotAuthorizedError(
                f"not authorized to describe or create topic {name!r} "
                f"({exc.args[0].name()}): grant this principal DESCRIBE (and CREATE, or create "
                "the topic beforehand) on it"
            ) from exc
        raise


_REFUSED = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError._AUTHENTICATION,
        KafkaError.SASL_AUTHENTICATION_FAILED,
    }
)


def refused(err: KafkaError) -> bool:
    """Whether the broker refused who we are (authentication) or what we may do (an ACL):
    no retry will change that, so it is reported, not retried."""
    return err.code() in _REFUSED


def misconfigured(exc: BaseException) -> bool:
    """Whether the Kafka client refused one of its own settings (not an outage: no broker,
    and no retry, would change that)."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error is not None and getattr(error, "code", lambda: None)() == KafkaError._INVALID_ARG


def partition_offsets(
    admin: AdminClient,
    topic: str,
    earliest: bool = False,
    partitions: Iterable[int] | None = None,
    timeout: float = 10.0,
) -> dict[int, int]:
    """Each partition's end offset (the next to be written), or its earliest; one offsets
    request, after a metadata request unless ``partitions`` names them. Raises
    ``KafkaException`` when the broker does not answer."""
    if partitions is None:
        partitions = admin.list_topics(topic, timeout=timeout).topics[topic].partitions
    spec = OffsetSpec.earliest() if earliest else OffsetSpec.latest()  # type: ignore[no-untyped-call]
    request = {TopicPartition(topic, p): spec for p in partitions}
    futures = admin.list_offsets(request, request_timeout=timeout)
    return {tp.partition: future.result().offset for tp, future in futures.items()}


# Refused as too large, by the broker or by the client's own check before sending (-141).
TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, -141})


def topic_limit(settings: Mapping[str, object], topic: str, timeout: float, create: int = 0) -> int:
    """The topic's max.message.bytes (the broker's default when the topic does not exist
    yet). ``create``: a missing topic is created with that many partitions (as
    :func:`ensure_topic` makes it). Raises :class:`NotAuthorizedError` when the broker
    refuses this principal, and ``KafkaException`` when no broker answers within
    ``timeout``."""
    # A bad setting raises here.
    admin = AdminClient(client_logging({**admin_settings(settings), "log_level": 3}))
    try:
        meta = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None:
            if create > 0:
                ensure_topic(admin, topic, create, timeout=timeout, exact_partitions=False)
            return 1_000_000
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
        entries = admin.describe_configs([resource])[resource].result(timeout=timeout)
        return int(entries["max.message.bytes"].value)
    except KafkaException as exc:
        if exc.args and refused(exc.args[0]):
            raise NotAuthorizedError(
                f"the broker refused this principal on topic {topic!r} "
                f"({exc.args[0].name()}): it needs DESCRIBE, DESCRIBE_CONFIGS and WRITE there"
            ) from exc
        raise


def _described(admin: AdminClient, name: str, timeout: float, exists: bool = False) -> Any:
    """The topic's metadata (None: no such topic). A topic another client has just created
    can show no partitions, or no leader, for a moment, and a broker that has just started
    can say it does not know a topic that exists (``exists``: the creation said it does);
    no topic has no partitions, so it is read again until it shows them with their leaders
    (or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    while True:
        topic = admin.list_topics(topic=name, timeout=timeout).topics.get(name)
        if topic is None or topic.error is not None:
            error = topic.error if topic is not None else None
            settling = (exists and not (error is not None and refused(error))) or (
                error is not None and error.code() == KafkaError.LEADER_NOT_AVAILABLE
            )
        else:
            settling = not topic.partitions
        if not settling or time.monotonic() >= deadline:
            return topic
        time.sleep(0.1)


def _until_served(admin: AdminClient, name: str, timeout: float) -> None:
    """Return once every partition of ``name`` (just created) has a leader that answers for
    it: the creation's answer comes before that, and a client asking the topic's offsets at
    once (``serve --decisions-topic`` does) would be told the topic is unknown or that the
    broker is not its leader. After ``timeout``, the last such error is raised."""
    deadline = time.monotonic() + timeout
    while True:
        topic = _described(admin, name, max(0.1, deadline - time.monotonic()), exists=True)
        try:
            if topic is not None and topic.error is not None:
                raise KafkaException(topic.error)
            if topic is None or not topic.partitions:
                unknown = KafkaError(KafkaError._UNKNOWN_TOPIC, f"{name!r} has no partitions yet")
                raise KafkaException(unknown)
            partition_offsets(admin, name, partitions=topic.partitions, timeout=timeout)
            return
        except KafkaException as exc:
            if (exc.args and refused(exc.args[0])) or time.monotonic() >= deadline:
                raise
        time.sleep(0.1)


def _created(future: Future[None], name: str, timeout: float) -> None:
    """Wait for the creation of topic ``name``; no answer in time (the cluster's controllers
    have no quorum, or are overloaded) is said as a ``KafkaException`` naming what it waits
    for (a bare ``TimeoutError`` would reach the user as a traceback)."""
    try:
        future.result(timeout=timeout)
    except TimeoutError:
        raise KafkaException(
            KafkaError(
                KafkaError.REQUEST_TIMED_OUT,  # a broker answers: the creation does not
                f"the cluster did not create topic {name!r} within {timeout:g} s: its "
                "controllers may have lost their quorum (a majority of them must run; "
                "scripts/services status says which are stopped)",
            )
        ) from None


@dataclass(frozen=True)
class _Wanted:
    """What :func:`ensure_topic` is asked of a topic (its arguments of the same names)."""

    partitions: int
    retention_ms: int | None
    replication_factor: int | None
    exact_partitions: bool
    log_append_time: bool
    config: Mapping[str, str] | None


def _ensure_topic(admin: AdminClient, name: str, wanted: _Wanted, timeout: float) -> bool:
    partitions, retention_ms = wanted.partitions, wanted.retention_ms
    replication_factor = wanted.replication_factor
    topic = _described(admin, name, timeout)
    if topic is not None and topic.error is not None and refused(topic.error):
        raise KafkaException(topic.error)
    exists = topic is not None and topic.error is None
    if not exists:
        settings = {"retention.ms": str(DEFAULT_RETENTION_MS), **(wanted.config or {})}
        if retention_ms is not None:
            settings["retention.ms"] = str(retention_ms)
        if wanted.log_append_time:
            settings["message.timestamp.type"] = "LogAppendTime"
        if replication_factor is None:
            brokers = len(admin.list_topics(topic=name, timeout=timeout).brokers)
            replication_factor, settings = default_replication(brokers, settings)
        futures = admin.create_topics(
            [NewTopic(name, partitions, replication_factor, config=settings)],
            operation_timeout=timeout,
        )
        try:
            _created(futures[name], name, timeout)
            logger.info(
                "created topic %s with %d partitions, replication %s",
                name,
                partitions,
                replication_factor if replication_factor > 0 else "default",
            )
            _until_served(admin, name, timeout)
            return True
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        topic = _described(admin, name, timeout, exists=True)
    if topic is None or topic.error is not None:
        raise KafkaException(
            topic.error
            if topic is not None
            else KafkaError(KafkaError._UNKNOWN_TOPIC, f"topic {name!r} is not in the metadata")
        )
    have = len(topic.partitions)
    if wanted.exact_partitions and have != partitions:
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
