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

The recorder reads on the one log loop (:class:`~kvledger.consumer.loop.LogLoop`), its
client's owner and its sink: a :class:`~kvledger.consumer.loop.TransactionSink`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from kvledger.consumer.db import connect
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.loop import LogLoop, Polled, filled, kafka_consumer
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.schemas.decisions import Answered, Decision, Record, decode_record
from kvledger.schemas.topics import STARTUP_TIMEOUT_S

logger = logging.getLogger(__name__)

BATCH = 500
# How far a record's time may be from its message's log time (its writer's clock against
# the broker's, and the lookup's time before the write): past it, refused.
MAX_SKEW_S = 600.0
# How long the recorder's thread waits for a batch to fill.
BATCH_WAIT_S = 0.5
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
        self.settings: dict[str, object] = {"bootstrap.servers": bootstrap_servers, **(kafka or {})}
        self.recorded = self.skipped = self.rejected = self.duplicates = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        self._consumer: Consumer | None = None
        self._taken = 0  # records the last turn took
        self._hints: dict[tuple[str, int], int] = {}  # committed, not yet hinted to Kafka

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="kvledger-decision-records", daemon=True
        )
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
                self.loop().run()
            except Exception as exc:  # the recorder outlives any one fault: it starts again
                logger.warning("decision records: %s; starting again in 2 s", exc)
                self.close()
                self._stop.wait(2.0)

    def open(self, wait_s: float = 0.0) -> bool:
        """Take the writer's lock and start reading where the stored offsets say; False
        when another recorder holds the lock (after waiting ``wait_s``)."""
        conn = connect(self.database_url, autocommit=True)
        lock = f"kvledger.decisions:{self.topic}"
        got = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (lock,)).fetchone()
        if not got or not got[0]:
            conn.close()
            self._stop.wait(wait_s)
            return False
        stored = PostgresStore(conn).stored_offsets(self.group_id, self.topic)
        conn.autocommit = False
        try:
            consumer = self._new_client(stored)
        except Exception:
            conn.close()
            raise
        self._conn, self._consumer = conn, consumer
        return True

    def _new_client(self, stored: dict[int, int]) -> Consumer:
        """A client of its own assignment of every partition, at the ``stored`` offsets."""
        consumer = kafka_consumer(
            {
                **self.settings,
                "group.id": f"{self.group_id}-records",
                "client.id": "kvledger-decision-records",
                "log_level": 4,
            }
        )
        metadata = consumer.list_topics(self.topic, timeout=STARTUP_TIMEOUT_S)
        found = metadata.topics.get(self.topic)
        if found is None or found.error is not None:
            consumer.close()
            raise OSError(f"decisions topic {self.topic}: {found.error if found else 'missing'}")
        at = [
            TopicPartition(self.topic, p, stored.get(p, OFFSET_BEGINNING)) for p in found.partitions
        ]
        consumer.assign(at)
        return consumer

    def loop(self) -> LogLoop:
        """The log's loop, this recorder its client's owner and its sink."""
        return LogLoop(
            self.topic, "the decision recorder", self, filled(BATCH, BATCH_WAIT_S), self, self._stop
        )

    # The loop's client owner and sink (consumer/loop.py's Client and TransactionSink).
    @property
    def client(self) -> Consumer:
        assert self._consumer is not None
        return self._consumer

    def renew(self) -> None:
        """A fatal client error: a new client, at the offsets stored with the rows."""
        assert self._conn is not None
        if self._consumer is not None:
            try:
                self._consumer.close()
            except KafkaException as exc:
                logger.warning("decision records: closing the failed client: %s", exc)
            self._consumer = None
        stored = PostgresStore(self._conn).stored_offsets(self.group_id, self.topic)
        self._conn.commit()
        self._consumer = self._new_client(stored)

    def lost(self, partitions: set[int]) -> None:
        """Records deleted before they were read are decisions the funnel will miss."""
        logger.warning(
            "decisions topic %s: partitions %s fell out of the log's range before they were "
            "read; the decisions lost are not recorded",
            *(self.topic, sorted(partitions)),
        )

    def turned(self, client: Consumer, polled: Polled) -> bool:
        return False

    def committed(self) -> dict[tuple[str, int], int]:
        hints, self._hints = self._hints, {}
        return hints

    # ------------------------------------------------------------------ a batch
    def run_batch(self, timeout_s: float = 1.0) -> int:
        """One turn of the loop: a batch read and written in one transaction; how many
        records it took."""
        assert self._conn is not None and self._consumer is not None
        self._taken = 0
        self.loop().turn(filled(BATCH, timeout_s))
        return self._taken

    def apply(self, batch: list[Inbound]) -> None:
        """The batch's rows, rejections and next offsets, in one transaction. A record that
        is not a decision, or one no decision could be (:func:`refusal`), is rejected with
        its bytes; one whose id is already recorded (a producer's retry, a replay) is a
        duplicate, and changes nothing; a row the database still refuses is rejected alone,
        the rest of the batch recorded."""
        self._taken = len(batch)
        nexts: dict[int, int] = {}
        rows: dict[uuid.UUID, tuple[Any, ...]] = {}  # by decision id: the first one counts
        rejects: list[tuple[str, int, int, bytes, str]] = []
        duplicates = 0
        for m in batch:
            nexts[m.partition] = m.offset + 1
            try:
                decision, record = decode_record(m.value)
                if record is not None and (why := refusal(decision, record, m)) is not None:
                    raise ValueError(why)
            except ValueError as exc:
                rejects.append((self.topic, m.partition, m.offset, m.value, str(exc)[:1000]))
                continue
            if record is None:
                self.skipped += 1
                continue
            key = uuid.UUID(record.id)
            if key in rows:
                duplicates += 1
                continue
            rows[key] = self._row(decision, record, m)
        conn = self._conn
        assert conn is not None
        with conn.cursor() as cur:
            known = cur.execute(
                "SELECT DISTINCT decision_id FROM kvledger.decisions WHERE decision_id = ANY(%s)",
                (list(rows),),
            ).fetchall()
            for (key,) in known:
                del rows[key]
                duplicates += 1
            recorded = self._insert(cur, list(rows.values()), rejects)
            if rejects:
                cur.executemany(_REJECT, rejects)
                for _, p, o, _, why in rejects:
                    logger.warning(
                        "decisions topic %s: partition %d offset %d is not a decision (%s); "
                        "kept in kvledger.rejected_decisions",
                        *(self.topic, p, o, why),
                    )
            cur.executemany(_OFFSET, [(self.group_id, self.topic, p, n) for p, n in nexts.items()])
        conn.commit()
        self._hints.update({(self.topic, p): n for p, n in nexts.items()})
        self.recorded += recorded
        self.rejected += len(rejects)
        self.duplicates += duplicates

    def _insert(
        self,
        cur: psycopg.Cursor[Any],
        rows: list[tuple[Any, ...]],
        rejects: list[tuple[str, int, int, bytes, str]],
    ) -> int:
        """Insert ``rows``: together, or, when the database refuses them together, one at
        a time, each refused one added to ``rejects`` with the database's reason."""
        if not rows:
            return 0
        try:
            with cur.connection.transaction():  # a savepoint: undone alone
                cur.executemany(_INSERT, [row[:-1] for row in rows])
            return len(rows)
        except (psycopg.DataError, psycopg.IntegrityError):
            pass
        done = 0
        for row in rows:
            try:
                with cur.connection.transaction():
                    cur.execute(_INSERT, row[:-1])
                done += 1
            except (psycopg.DataError, psycopg.IntegrityError) as exc:
                topic, partition, offset, raw = row[-4:]
                rejects.append((topic, partition, offset, raw, f"the database: {exc}"[:1000]))
        return done

    def _row(self, decision: Decision | Answered, record: Record, m: Inbound) -> tuple[Any, ...]:
        """The decisions table's row of one record (its raw bytes last: not a column)."""
        offered = [
            {
                "instance": o.instance,
                "medium": o.medium,
                "ownership": o.ownership,
                "blocks": o.blocks,
                "state": o.state,
            }
            for o in record.offered
        ]
        return (
            uuid.UUID(record.id),
            datetime.fromtimestamp(record.at, UTC),
            decision.model,
            decision.group_idx,
            decision.request_id,
            decision.origin,
            decision.instance if isinstance(decision, Decision) else None,
            record.chosen_state,
            record.block_size,
            record.prompt_blocks,
            bytes.fromhex(record.first_hash) if record.first_hash else None,
            bytes.fromhex(record.last_hash) if record.last_hash else None,
            [bytes.fromhex(h) for h in record.captured_hashes]
            if record.captured_hashes is not None
            else None,
            record.available_blocks,
            record.available_tier,
            record.captured_blocks,
            record.captured_tier,
            record.silent_blocks,
            json.dumps(offered),
            self.topic,
            m.partition,
            m.offset,
            m.value,
        )


def refusal(decision: Decision | Answered, record: Record, message: Inbound) -> str | None:
    """Why ``record`` cannot be a decision the index offered, or None: a NUL in a text
    (PostgreSQL's text holds none), counts out of order (what a holder had is within the
    prompt; the chosen instance had at most what the best holder, live or silent, had),
    or a time more than :data:`MAX_SKEW_S` from when the message was written."""
    texts = [
        decision.model,
        decision.origin,
        decision.request_id,
        record.chosen_state,
        record.available_tier,
        record.captured_tier,
    ]
    if isinstance(decision, Decision):
        texts.append(decision.instance)
    for o in record.offered:
        texts += (o.instance, o.medium, o.ownership, o.state)
    if any(t is not None and "\x00" in t for t in texts):
        return "a text holds NUL (0x00), which PostgreSQL's text cannot"
    prompt = record.prompt_blocks
    most = max(record.available_blocks, record.silent_blocks)
    if most > prompt or any(o.blocks > prompt for o in record.offered):
        return f"a holder had more blocks than the prompt's {prompt}"
    captured = record.captured_blocks
    if captured is not None and captured > most:
        return f"captured {captured} blocks, more than any holder had ({most})"
    if captured is not None and len(record.captured_hashes or ()) > captured:
        return f"{len(record.captured_hashes or ())} captured hashes for {captured} blocks"
    written = message.timestamp_ms / 1000 if message.timestamp_ms is not None else time.time()
    if abs(record.at - written) > MAX_SKEW_S:
        return f"decided at {record.at:.0f}, {record.at - written:+.0f} s from when it was written"
    return None


def summary(conn: psycopg.Connection, since: datetime) -> dict[str, Any]:
    """The funnel since ``since`` over every model and instance (sums of the view)."""
    row = conn.execute(
        "SELECT coalesce(sum(decisions), 0), coalesce(sum(prompt_blocks), 0), "
        "coalesce(sum(available_blocks), 0), coalesce(sum(captured_blocks), 0), "
        "coalesce(sum(delivered_blocks), 0), coalesce(sum(delivered_known), 0), "
        "coalesce(sum(unreported), 0), coalesce(sum(unreported_available_blocks), 0) "
        "FROM kvledger.decision_funnel WHERE minute >= date_trunc('minute', %s::timestamptz) "
        "AND minute <= now()",
        (since,),
    ).fetchone()
    assert row is not None
    keys = (
        "decisions",
        "prompt_blocks",
        "available_blocks",
        "captured_blocks",
        "delivered_blocks",
        "delivered_known",
        "unreported",
        "unreported_available_blocks",
    )
    return {k: int(v) for k, v in zip(keys, row, strict=True)}
