"""One line for a command pointed at a topic that does not exist (a typo, or the defaults
after a first run on another topic): which topics do exist, and the nearest one."""

from __future__ import annotations

import difflib
from collections.abc import Mapping


def missing_topic(kafka: Mapping[str, object], topic: str, timeout: float) -> str | None:
    """Why ``topic`` cannot be read: it does not exist on the broker (``kafka``: the client
    settings, ``bootstrap.servers`` among them), naming the topics there; None when it
    exists or the broker will not say (an authorization: the command then says what it
    lacks). A broker that does not answer raises its ``KafkaException``, at once: the
    command reports it, without waiting for it a second time."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    from kvledger.schemas.kafka_log import client_logging
    from kvledger.schemas.topics import admin_settings

    admin = AdminClient(client_logging({**admin_settings(dict(kafka)), "log_level": 3}))
    try:
        found = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        # Only a broker's "no such topic" counts: one the client may not describe (ACLs)
        # is hidden from a plain listing, and the command then says what it lacks.
        if found is None or found.error is None:
            return None
        if found.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        topics = admin.list_topics(timeout=timeout).topics
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        name = error.name() if error is not None and hasattr(error, "name") else ""
        if name in {"_TRANSPORT", "_TIMED_OUT", "_ALL_BROKERS_DOWN"}:
            raise
        return None
    names = sorted(t for t in topics if not t.startswith("__"))
    close = difflib.get_close_matches(topic, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else "pass --topic; "
    there = f"topics there: {', '.join(names[:20])}" if names else "the broker has no topics"
    return f"topic {topic!r} does not exist on the broker: {hint}{there}"
