"""How many copies of a topic the cluster keeps, and whether that is enough for its settings.

kvledger writes with ``acks=all`` (the publisher, the relay, the dead-letter and decisions
producers): a write is acknowledged once ``min.insync.replicas`` replicas hold it. A topic
whose replication leaves no room for a broker's loss, or that has fewer replicas in sync than
that setting asks, stops writes or loses records when a broker goes. :func:`replication_problem`
decides (no I/O); :func:`warn_under_replicated` asks the cluster and logs one warning per
topic, once per process, at the start of each command that produces or consumes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from kvledger.schemas.kafka_log import client_logging

logger = logging.getLogger(__name__)

# The replication kvledger gives a topic it creates on a cluster of at least this many
# brokers, and the min.insync.replicas it sets there: one broker may be lost and every
# acknowledged record is still on two.
PRODUCTION_REPLICAS = 3
PRODUCTION_MIN_INSYNC = 2
MIN_INSYNC = "min.insync.replicas"


def default_replication(
    brokers: int, config: Mapping[str, str] | None = None
) -> tuple[int, dict[str, str]]:
    """The replication factor and topic settings kvledger creates a topic with when the caller
    names no replication factor: ``min(3, brokers)`` replicas, and on three brokers or more
    ``min.insync.replicas=2`` unless ``config`` sets it. ``brokers``: those the cluster's
    metadata lists (at least one is assumed)."""
    settings = dict(config or {})
    replicas = max(1, min(PRODUCTION_REPLICAS, brokers))
    if replicas >= PRODUCTION_REPLICAS:
        settings.setdefault(MIN_INSYNC, str(PRODUCTION_MIN_INSYNC))
    return replicas, settings


@dataclass(frozen=True)
class TopicReplication:
    """What the cluster says of one topic: ``replicas`` and ``in_sync`` are the fewest of any
    of its partitions (``in_sync_partition`` is that partition), ``brokers`` those the
    cluster's metadata lists now."""

    topic: str
    replicas: int
    in_sync: int
    min_insync: int
    brokers: int
    in_sync_partition: int = 0


def replication_problem(state: TopicReplication) -> str | None:
    """Why ``state``'s topic is under-replicated for its settings, in one sentence; None when
    it is not. The cases:

    - fewer replicas than ``min.insync.replicas``: every ``acks=all`` write is refused;
    - replicas no more than ``min.insync.replicas`` while the cluster has brokers to spare:
      one broker's loss stops writes;
    - fewer replicas in sync (on some partition) than ``min.insync.replicas``: writes are
      refused until a broker comes back;
    - one replica on a cluster of three brokers or more: a broker's loss loses records.

    A single broker with one replica (the local default) is none of these.
    """
    s = state
    reasons: list[str] = []
    if s.replicas < s.min_insync:
        reasons.append(
            f"replication factor {s.replicas} is below its min.insync.replicas={s.min_insync}: "
            "every write with acks=all is refused (NOT_ENOUGH_REPLICAS)"
        )
    elif s.replicas < s.min_insync + 1 and s.brokers > s.replicas:
        reasons.append(
            f"replication factor {s.replicas} with min.insync.replicas={s.min_insync} leaves "
            "no broker to lose: one broker down stops writes"
        )
    if s.min_insync <= s.replicas and s.in_sync < s.min_insync:
        reasons.append(
            f"partition {s.in_sync_partition} has {s.in_sync} of {s.replicas} replicas in "
            f"sync, fewer than min.insync.replicas={s.min_insync}: writes with acks=all are "
            "refused until a broker returns"
        )
    if s.replicas == 1 and s.brokers >= PRODUCTION_REPLICAS:
        reasons.append(
            f"replication factor 1 on a cluster of {s.brokers} brokers: a broker's loss loses "
            "its records"
        )
    if not reasons:
        return None
    return (
        f"topic {s.topic!r} is under-replicated: " + "; ".join(reasons) + " (see "
        "docs/operations.md, 'A production cluster')"
    )


def describe_replication(
    admin: AdminClient, topics: Iterable[str], timeout: float
) -> list[TopicReplication]:
    """What the cluster says of each of ``topics`` that exists (one missing is left out: the
    command creates it). Raises ``KafkaException`` when the broker does not answer or refuses
    the request."""
    found: dict[str, TopicReplication] = {}
    brokers = 0
    for name in dict.fromkeys(topics):
        meta = admin.list_topics(topic=name, timeout=timeout)
        brokers = len(meta.brokers)
        topic = meta.topics.get(name)
        if topic is None or topic.error is not None or not topic.partitions:
            continue
        fewest = min(topic.partitions.values(), key=lambda p: (len(p.isrs), p.id))
        found[name] = TopicReplication(
            topic=name,
            replicas=min(len(p.replicas) for p in topic.partitions.values()),
            in_sync=len(fewest.isrs),
            in_sync_partition=fewest.id,
            min_insync=1,
            brokers=brokers,
        )
    if not found:
        return []
    resources = [ConfigResource(ConfigResource.Type.TOPIC, name) for name in found]
    futures = admin.describe_configs(resources, request_timeout=timeout)
    out = []
    for resource, future in futures.items():
        entries = future.result(timeout=timeout)
        state = found[resource.name]
        min_insync = int(entries[MIN_INSYNC].value) if MIN_INSYNC in entries else 1
        out.append(
            TopicReplication(
                state.topic,
                state.replicas,
                state.in_sync,
                min_insync,
                brokers,
                state.in_sync_partition,
            )
        )
    return out


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_under_replicated(
    bootstrap: str,
    kafka: Mapping[str, object] | None,
    topics: Iterable[str],
    timeout: float = 10.0,
) -> list[str]:
    """Log one WARNING for each of ``topics`` that is under-replicated for its settings
    (:func:`replication_problem`), once per topic and cluster in this process; returns the
    warnings logged now. A cluster that does not answer, or that refuses this principal the
    topic's description, is passed over in silence (at DEBUG): the command reports the broker
    itself, and the check never stops it."""
    from kvledger.schemas.topics import admin_settings  # topics imports this module

    settings = {**admin_settings(kafka or {}), "bootstrap.servers": bootstrap, "log_level": 3}
    try:
        admin = AdminClient(client_logging(settings))
        states = describe_replication(admin, topics, timeout)
    except (KafkaException, ValueError) as exc:
        logger.debug("replication of %s not checked: %s", ", ".join(topics), exc)
        return []
    said = []
    for state in states:
        problem = replication_problem(state)
        with _warned_lock:
            if problem is None or (bootstrap, state.topic) in _warned:
                continue
            _warned.add((bootstrap, state.topic))
        logger.warning("%s", problem)
        said.append(problem)
    return said


def warn_under_replicated_later(
    bootstrap: str, kafka: Mapping[str, object] | None, topics: Iterable[str]
) -> threading.Thread:
    """:func:`warn_under_replicated` in a daemon thread: for a long-running command, whose
    start-up it must not delay while the broker is slow or away."""
    names = list(topics)
    thread = threading.Thread(
        target=warn_under_replicated,
        args=(bootstrap, kafka, names),
        name="kvledger-replication-check",
        daemon=True,
    )
    thread.start()
    return thread
