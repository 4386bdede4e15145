"""Consumer configuration, read once at the edge (CLI) and passed in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvledger.consumer.retention_policy import Retention

DEFAULT_GROUP = "kvledger-index"
# The dead-letter topic of a topic: its name and this suffix (kv-events.dlq).
DLQ_SUFFIX = ".dlq"


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    bootstrap_servers: str
    database_url: str
    topic: str = "kv-events"
    group_id: str = DEFAULT_GROUP
    # "": the topic's own, <topic>.dlq; None: rejections are stored in rejected_events only
    # (rebuilds, verification).
    dlq_topic: str | None = ""
    batch_size: int = 5000
    batch_timeout_s: float = 0.5
    until_caught_up: bool = False
    # Stop once every partition's stored offset reaches these (partition -> offset); messages
    # at or past them are not applied. For rebuilds that must end where another index ends.
    stop_at: Mapping[int, int] | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the metrics listen here only unless told otherwise
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 10.0
    # A batch that keeps failing with an error that looks transient on a working connection
    # (a serialization failure, say) is tried this many times, then split to find the
    # message that causes it (a database outage is retried without end).
    max_batch_retries: int = 5
    # The dead-letter topic, when the consumer creates it: -1 takes the cluster's default
    # replication factor; more topic settings (e.g. min.insync.replicas) in the mapping.
    dlq_replication_factor: int = -1
    dlq_topic_config: Mapping[str, str] = field(default_factory=dict)
    # Prefetched messages held by the client, per partition and in all: the consumer's memory
    # bound while it is far behind.
    queued_max_kbytes: int = 16384
    # Static membership: a restarted consumer with the same id takes its partitions back at
    # once instead of waiting for the session of its dead predecessor to time out.
    group_instance_id: str | None = None
    session_timeout_ms: int = 10000
    kafka: Mapping[str, object] = field(default_factory=dict)
    # How long history, audit and dead blocks are kept, applied by a pass every
    # retention_every_s from a thread of the consumer's own (consumer/retention.py). None:
    # nothing is deleted (a rebuild's scratch index); partitions are still made ahead.
    retention: Retention | None = None
    retention_every_s: float = 60.0
    # Plan each batch while the one before it is written (consumer/ahead.py): a second
    # database connection, and PostgreSQL's work overlapped with the consumer's.
    plan_ahead: bool = True

    @property
    def dead_letter_topic(self) -> str | None:
        """Where rejections are sent: ``dlq_topic``, or the topic's own ``<topic>.dlq``."""
        return self.dlq_topic if self.dlq_topic != "" else self.topic + DLQ_SUFFIX
