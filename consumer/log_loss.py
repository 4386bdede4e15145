"""Records the log lost before the index read them (retention deleted them while the
consumer was away or behind): recorded, and what they could have changed ended.

The stored offset of a partition below its first offset means the index never read the
records between: removals, restarts, clears the index cannot know of. So, in one
transaction with moving the stored offset to the partition's first (a crash before it
commits leaves everything as it was, and the next start does it again):

- every residency established by a message of that partition ends, every tier (a source's
  stream lives on one partition: these are the residencies of the streams whose records
  were lost), its open history interval closed as ``cleared``;
- the loss is a row of ``kvledger.log_losses`` (the group, the partition, the offsets
  lost, when, how many residencies ended), which `kvledger sources` shows.

Reading then goes on from the partition's first offset; what the streams publish after
the loss establishes their blocks again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psycopg
from confluent_kafka.admin import AdminClient

from kvledger.consumer import metrics
from kvledger.schemas.topics import partition_offsets

logger = logging.getLogger("kvledger.consumer.service")

_CLOSE = """
UPDATE kvledger.residency_history h
SET removed_at = GREATEST(now(), h.stored_at), removed_by = 'cleared', closed_at = now()
FROM kvledger.residencies r
WHERE r.kafka_topic = %(topic)s AND r.kafka_partition = %(partition)s
  AND h.model = r.model AND h.group_idx = r.group_idx AND h.block_hash = r.block_hash
  AND h.instance = r.instance AND h.medium = r.medium AND h.ownership = r.ownership
  AND h.removed_at IS NULL AND coalesce(h.closed_at, 'infinity'::timestamptz) = 'infinity'
"""
_END = """
DELETE FROM kvledger.residencies
WHERE kafka_topic = %(topic)s AND kafka_partition = %(partition)s
RETURNING instance
"""
_MOVE = """
UPDATE kvledger.consumer_offsets SET next_offset = %(first)s, updated_at = now()
WHERE consumer_group = %(group)s AND kafka_topic = %(topic)s
  AND kafka_partition = %(partition)s AND next_offset = %(stored)s
"""
_RECORD = """
INSERT INTO kvledger.log_losses (consumer_group, kafka_topic, kafka_partition,
    first_lost_offset, last_lost_offset, ended_residencies, sources)
VALUES (%(group)s, %(topic)s, %(partition)s, %(stored)s, %(last)s, %(ended)s, %(sources)s)
"""


@dataclass(frozen=True, slots=True)
class LogLoss:
    """What a loss ended: ``None`` from :func:`end_lost` when another consumer had already
    moved the partition's offset (it recorded the loss)."""

    partition: int
    first_lost: int
    last_lost: int
    ended: int
    sources: tuple[str, ...]


def end_lost(  # noqa: PLR0913 - one loss: a partition's coordinates and its two offsets
    conn: psycopg.Connection, group: str, topic: str, partition: int, stored: int, first: int
) -> LogLoss | None:
    """Records ``stored`` .. ``first`` - 1 of ``topic[partition]`` lost for ``group``: end
    what they could have changed and move the stored offset to ``first``, at once."""
    args = {
        "group": group,
        "topic": topic,
        "partition": partition,
        "stored": stored,
        "first": first,
        "last": first - 1,
    }
    with conn.transaction():
        moved = conn.execute(_MOVE, args).rowcount
        if moved != 1:  # another member of the group moved it first: its loss to record
            return None
        conn.execute(_CLOSE, args)
        rows = conn.execute(_END, args).fetchall()
        sources = tuple(sorted({r[0] for r in rows}))
        conn.execute(_RECORD, {**args, "ended": len(rows), "sources": list(sources)})
    return LogLoss(partition, stored, first - 1, len(rows), sources)


def below_start(
    admin: AdminClient, topic: str, stored: Mapping[int, int], partitions: Iterable[int]
) -> dict[int, int]:
    """The partitions among ``partitions`` whose stored offset is below their first one:
    partition -> its first offset (raises ``KafkaException`` when the broker does not
    answer)."""
    behind = [p for p in partitions if stored.get(p, -1) > 0]
    if not behind:
        return {}
    first = partition_offsets(admin, topic, earliest=True, partitions=behind, timeout=5)
    return {p: first[p] for p in behind if first.get(p, 0) > stored[p]}


def act_on_losses(
    conn: psycopg.Connection,
    group: str,
    topic: str,
    stored: Mapping[int, int],
    lost: Mapping[int, int],
) -> list[LogLoss]:
    """Each lost range recorded and acted on (:func:`end_lost`), said aloud and counted."""
    out = []
    for p, first in sorted(lost.items()):
        loss = end_lost(conn, group, topic, p, stored[p], first)
        if loss is None:
            continue
        out.append(loss)
        metrics.RECORDS_LOST.labels(topic, str(p)).inc(first - stored[p])
        whose = ", ".join(loss.sources) if loss.sources else "none"
        logger.error(
            "%s[%d]: %d record(s), offsets %d..%d, were deleted from the log before this index "
            "read them: the %d residencies of the streams on that partition are ended (sources: "
            "%s), as a lost gap ends them, and reading goes on at %d",
            topic,
            p,
            first - stored[p],
            stored[p],
            first - 1,
            loss.ended,
            whose,
            first,
        )
    return out
