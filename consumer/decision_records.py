"""Routing decisions into PostgreSQL: the decisions topic's records (written by every
replica of ``kvledger serve --memory --decisions-topic``) become rows of
``kvledger.decisions`` (migration 0018), from which ``kvledger.decision_outcomes`` and
``kvledger.decision_funnel`` tell available, captured and delivered reuse.

Exactly once: each batch's rows and the topic's next offsets (``kvledger.consumer_offsets``,
under ``<consumer group>:decisions`` and the decisions topic, which a rebuild keeps) are one
transaction, and the reader starts from the offsets stored there. One recorder writes at a
time: it holds a session advisory lock named after the topic, and a second one (another
``consume`` of the same group) waits for it. A record that is only a hint (version 1, no
offer) is skipped; an answer no choice was reported for (Dynamo's ``/query``) is kept with
no chosen instance (migration 0019); one that is not a decision at all is kept in
``kvledger.rejected_decisions`` with its bytes and the reason. The lookup path never waits
for any of this.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from kvledger.consumer.db import connect
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.schemas.decisions import Decision, decode_record
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import STARTUP_TIMEOUT_S

logger = logging.getLogger(__name__)

BATCH = 500
_INSERT = """
INSERT INTO kvledger.decisions (decision_id, decided_at, model, group_idx, request_id, origin,
    chosen, chosen_state, block_size, prompt_blocks, first_hash, last_hash, captured_hashes,
    available_blocks, available_tier, captured_blocks, captured_tier, silent_blocks, offered,
    kafka_topic, kafka_partition, kafka_offset)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
"""
_REJECT = """
INSERT INTO kvledger.rejected_decisions (kafka_topic, kafka_partition, kafka_offset, raw, reason)
VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING
"""
_OFFSET = """
INSERT INTO kvledger.consumer_offsets (consumer_group, kafka_topic, kafka_partition, next_offset)
VALUES (%s, %s, %s, %s)
ON CONFLICT (consumer_group, kafka_topic, kafka_partition)
DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now()
"""


class DecisionRecorder:
    """Reads ``topic`` into ``database_url``'s decisions tables; :meth:`start` runs it on a
    thread of its own, :meth:`stop` ends it; :meth:`run_batch` is one pass (tests)."""

    def __init__(
        self,
        database_url: str,
        bootstrap_servers: str,
        topic: str,
        group_id: str,
        kafka: dict[str, object] | None = None,
    ) -> None:
        self.database_url, self.topic = database_url, topic
        self.group_id = f"{group_id}:decisions"  # its offsets' name: kept by a rebuild
        self.settings: dict[str, object] = {"bootstrap.servers": bootstrap_servers,
                                            **(kafka or {})}  # fmt: skip
        self.recorded = self.skipped = self.rejected = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        self._consumer: Consumer | None = None

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvledger-decision-records",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.close()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._consumer is None and not self.open(wait_s=1.0):
                    continue
                self.run_batch(timeout_s=0.5)
            except Exception as exc:  # the recorder outlives any one fault: it starts again
                logger.warning("decision records: %s; starting again in 2 s", exc)
                self.close()
                self._stop.wait(2.0)

    def open(self, wait_s: float = 0.0) -> bool:
        """Take the writer's lock and start reading where the stored offsets say; False
        when another recorder holds the lock (after waiting ``wait_s``)."""
        conn = connect(self.database_url, autocommit=True)
        got = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                           (f"kvledger.decisions:{self.topic}",)).fetchone()  # fmt: skip
        if not got or not got[0]:
            conn.close()
            self._stop.wait(wait_s)
            return False
        stored = PostgresStore(conn).stored_offsets(self.group_id, self.topic)
        conn.autocommit = False
        consumer = Consumer(client_logging({
            **self.settings, "group.id": f"{self.group_id}-records",
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "client.id": "kvledger-decision-records", "log_level": 4,
        }))  # fmt: skip
        metadata = consumer.list_topics(self.topic, timeout=STARTUP_TIMEOUT_S)
        found = metadata.topics.get(self.topic)
        if found is None or found.error is not None:
            consumer.close()
            conn.close()
            raise OSError(f"decisions topic {self.topic}: {found.error if found else 'missing'}")
        consumer.assign([TopicPartition(self.topic, p, stored.get(p, OFFSET_BEGINNING))
                         for p in found.partitions])  # fmt: skip
        self._conn, self._consumer = conn, consumer
        return True

    # ------------------------------------------------------------------ a batch
    def run_batch(self, timeout_s: float = 1.0) -> int:
        """One batch read and written in one transaction; how many records it took."""
        assert self._conn is not None and self._consumer is not None
        messages = self._consumer.consume(BATCH, timeout=timeout_s)
        taken: list[Message] = []
        for m in messages:
            err = m.error()
            if err is None:
                taken.append(m)
            elif err.code() != KafkaError._PARTITION_EOF:
                logger.warning("decision records: %s", err)
        if not taken:
            return 0
        nexts: dict[int, int] = {}
        rows, rejects = [], []
        for m in taken:
            partition, offset, raw = m.partition(), m.offset(), m.value() or b""
            assert partition is not None and offset is not None
            nexts[partition] = offset + 1
            try:
                decision, record = decode_record(raw)
            except ValueError as exc:
                rejects.append((self.topic, partition, offset, raw, str(exc)[:1000]))
                continue
            if record is None:
                self.skipped += 1
                continue
            hashes = [bytes.fromhex(h) for h in record.captured_hashes or ()]
            first = bytes.fromhex(record.first_hash) if record.first_hash else None
            last = bytes.fromhex(record.last_hash) if record.last_hash else None
            offered = [{"instance": o.instance, "medium": o.medium, "ownership": o.ownership,
                        "blocks": o.blocks, "state": o.state} for o in record.offered]  # fmt: skip
            rows.append((
                uuid.UUID(record.id), datetime.fromtimestamp(record.at, UTC), decision.model,
                decision.group_idx, decision.request_id, decision.origin,
                decision.instance if isinstance(decision, Decision) else None,
                record.chosen_state, record.block_size, record.prompt_blocks, first, last,
                hashes if record.captured_hashes is not None else None,
                record.available_blocks, record.available_tier, record.captured_blocks,
                record.captured_tier, record.silent_blocks, json.dumps(offered),
                self.topic, partition, offset,
            ))  # fmt: skip
        conn = self._conn
        with conn.cursor() as cur:
            if rows:
                cur.executemany(_INSERT, rows)
            if rejects:
                cur.executemany(_REJECT, rejects)
                for _, p, o, _, why in rejects:
                    logger.warning("decisions topic %s: partition %d offset %d is not a "
                                   "decision (%s); kept in kvledger.rejected_decisions",
                                   self.topic, p, o, why)  # fmt: skip
            cur.executemany(_OFFSET, [(self.group_id, self.topic, p, n)
                                      for p, n in nexts.items()])  # fmt: skip
        conn.commit()
        self.recorded += len(rows)
        self.rejected += len(rejects)
        return len(taken)


def summary(conn: psycopg.Connection, since: datetime) -> dict[str, Any]:
    """The funnel since ``since`` over every model and instance (sums of the view)."""
    row = conn.execute(
        "SELECT coalesce(sum(decisions), 0), coalesce(sum(prompt_blocks), 0), "
        "coalesce(sum(available_blocks), 0), coalesce(sum(captured_blocks), 0), "
        "coalesce(sum(delivered_blocks), 0), coalesce(sum(delivered_known), 0), "
        "coalesce(sum(unreported), 0), coalesce(sum(unreported_available_blocks), 0) "
        "FROM kvledger.decision_funnel WHERE minute >= date_trunc('minute', %s::timestamptz)",
        (since,),
    ).fetchone()
    assert row is not None
    keys = ("decisions", "prompt_blocks", "available_blocks", "captured_blocks",
            "delivered_blocks", "delivered_known", "unreported",
            "unreported_available_blocks")  # fmt: skip
    return {k: int(v) for k, v in zip(keys, row, strict=True)}
