"""The index consumer's Kafka side: the client's lifecycle around the batch pipeline.

:meth:`IndexConsumer.run` polls up to ``batch_size`` messages (or ``batch_timeout_s``),
hands them to :func:`~kvledger.consumer.pipeline.run_batch` (decode, plan and write in one
transaction with the offsets; its docstring has the commit order), then commits the offsets
to Kafka only as a hint for lag tools (auto-commit is off). With ``plan_ahead`` (the
default) a batch is planned while the one before it is written (:mod:`.ahead`): the same
transactions in the same order, PostgreSQL's work and the consumer's overlapped.

What stays here: assignment (seek to the offsets stored in PostgreSQL, so a crash at any
instant neither loses nor double-applies a message), error triage (a fatal client error
starts a new client), retries with backoff of a batch that failed on a database or
dead-letter error, re-seeking after a fenced batch, lag.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import start_http_server

from kvledger.consumer import metrics
from kvledger.consumer.ahead import Ahead
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect
from kvledger.consumer.dlq import DeadLetterError, DeadLetterProducer
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.log_loss import act_on_losses, below_start
from kvledger.consumer.loop import LogLoop, Polled
from kvledger.consumer.pipeline import BatchResult, decode_batch, fence_points, run_batch
from kvledger.consumer.retention import Retainer, ensure_partitions
from kvledger.consumer.store.base import FencedError
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.consumer.summary import RunSummary
from kvledger.schemas.codec import Codec
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import admin_settings, partition_offsets

logger = logging.getLogger(__name__)

_RETRYABLE = (psycopg.OperationalError, psycopg.errors.SerializationFailure, DeadLetterError)


ProgressFn = Callable[[RunSummary, int], None]
# How often a consumer with a progress function reports (and reads its lag).
PROGRESS_INTERVAL_S = 1.0

# How the batch in flight ended (IndexConsumer._drain): committed as planned; failed and
# applied again from the store; fenced (the partitions were re-seeked).
CLEAN, REDONE, FENCED = "clean", "redone", "fenced"


def stored_offsets(conn: psycopg.Connection, group: str, topic: str) -> dict[int, int]:
    """Each partition's next offset for ``group`` as the index stored it."""
    return PostgresStore(conn).stored_offsets(group, topic)


class IndexConsumer:
    """Materializes the topic into the index (see the module docstring)."""

    def __init__(
        self,
        config: ConsumerConfig,
        codec: Codec | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.config = config
        self.codec = codec or Codec()
        self.progress = progress
        self._progress_due = 0.0  # time.monotonic() from which progress is reported again
        self.summary = RunSummary()
        self._stop = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._store: PostgresStore | None = None
        # Planning ahead (consumer/ahead.py): the reads' connection (loads, stored offsets)
        # beside the writer's (self._conn, the writer thread's while a batch is in flight).
        self._reads: psycopg.Connection | None = None
        self._ahead: Ahead | None = None
        # Where this consumer's reading of each partition began: its seek, then the end of
        # each batch it applied (run_batch's read_from).
        self._read_from: dict[tuple[str, int], int] = {}
        self._consumer: Consumer | None = None
        # The client's assignment and read positions as its own thread last saw them: other
        # threads (lag(), a demo's progress) read these, never the client, whose calls
        # wait on one another (a consume() of the loop would starve them).
        self._assigned: frozenset[int] = frozenset()
        self._positions: dict[int, int] = {}
        self._dlq: DeadLetterProducer | None = None
        self._admin = AdminClient(client_logging(
            {**admin_settings(config.kafka), "bootstrap.servers": config.bootstrap_servers,
             "log_level": 4}
        ))  # fmt: skip

    def stop(self) -> None:
        """Ask the loop to finish its current batch and return (signal-handler safe)."""
        self._stop.set()

    # ------------------------------------------------------------------ the pipeline
    def run(self) -> RunSummary:
        """Open what a run needs, follow the topic (:class:`~kvledger.consumer.loop.LogLoop`,
        this consumer its client's owner and its sink) until stopped, caught up or at
        ``stop_at``, then close it all."""
        cfg = self.config
        if cfg.metrics_port:
            start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=metrics.REGISTRY)
        started = time.monotonic()
        self._conn = self._connect()
        retainer = None
        try:
            if cfg.dead_letter_topic:
                self._dlq = DeadLetterProducer(
                    cfg.bootstrap_servers, cfg.dead_letter_topic, settings=cfg.kafka,
                    replication_factor=cfg.dlq_replication_factor,
                    topic_config=cfg.dlq_topic_config, derived=cfg.dlq_topic == "",
                )  # fmt: skip
            self._consumer = self._new_consumer()
            if cfg.retention is not None:  # its first pass makes the partitions ahead
                retainer = Retainer(cfg.database_url, cfg.retention, cfg.retention_every_s)
                retainer.start()
            else:
                ensure_partitions(self._conn)
            if cfg.plan_ahead:
                self._reads = self._connect()
                self._ahead = Ahead(PostgresStore(self._reads), cfg.group_id)
            # Batches are filled (each is a PostgreSQL transaction): a busy topic's stay
            # large. The router's loop takes promptly instead (consumer/loop.py).
            LogLoop(
                cfg.topic, f"the consumer of group {cfg.group_id!r}", self,
                lambda client: client.consume(cfg.batch_size, timeout=cfg.batch_timeout_s),
                self, self._stop, cfg.stop_at, needs=f" and READ on group {cfg.group_id!r}",
            ).run()  # fmt: skip
            self._drain()
        finally:
            self.summary.seconds = time.monotonic() - started
            if self._ahead is not None:  # what it holds ends, committed or not, first
                self._ahead.close()
                self._ahead = None
            if self._reads is not None:
                self._reads.close()
                self._reads = None
            if retainer is not None:
                retainer.stop()
            if self._consumer is not None:
                self._consumer.close()
            if self._dlq is not None:
                self._dlq.close()
            self._conn.close()
        return self.summary

    # The loop's client owner and sink (consumer/loop.py's Client and Sink).
    @property
    def client(self) -> Consumer:
        assert self._consumer is not None
        return self._consumer

    def renew(self) -> None:
        self._drain()
        self._recreate_consumer()

    def apply(self, batch: list[Inbound]) -> None:
        if self._ahead is not None:
            self._apply_ahead(batch)
        else:
            self._apply(batch)

    def lost(self, partitions: set[int]) -> None:
        self._on_reset(partitions)

    def turned(self, client: Consumer, polled: Polled) -> bool:
        cfg = self.config
        # A turn that did not hand over a full batch has nothing more to overlap: the batch
        # in flight is waited for, so an idle or stopping consumer has applied all it read.
        if len(polled.batch) < cfg.batch_size:
            self._drain()
        if self._ahead is None or not self._ahead.busy:
            self._note_positions(client)  # all it read is applied now
        if cfg.stop_at is not None and self._reached(cfg.stop_at):
            return True
        return bool(cfg.until_caught_up and polled.received < cfg.batch_size and self._caught_up())

    def _new_consumer(self) -> Consumer:
        cfg = self.config
        settings: dict[str, object] = {
            "bootstrap.servers": cfg.bootstrap_servers,
            "group.id": cfg.group_id,
            "enable.auto.commit": False,
            # A stored offset out of the log's range is an error to act on (records lost
            # before they were read: log_loss.py), never a silent jump.
            "auto.offset.reset": "error",
            "client.id": f"kvledger-consumer-{cfg.group_id}",
            "fetch.max.bytes": 52428800,
            "max.partition.fetch.bytes": 4194304,
            "session.timeout.ms": cfg.session_timeout_ms,
            "queued.max.messages.kbytes": cfg.queued_max_kbytes,
        }
        if cfg.group_instance_id:
            settings["group.instance.id"] = cfg.group_instance_id
        settings.update(cfg.kafka)
        consumer = Consumer(client_logging(settings))
        consumer.subscribe([cfg.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        return consumer

    def _recreate_consumer(self) -> None:
        old = self._consumer
        self._consumer = None
        if old is not None:
            try:
                old.close()
            except KafkaException as exc:
                logger.warning("closing the failed client: %s", exc)
        self.summary.restarts += 1
        time.sleep(self.config.retry_backoff_s)
        self._consumer = self._new_consumer()

    def _apply(
        self, batch: list[Inbound], poisoned: dict[tuple[str, int, int], str] | None = None
    ) -> None:
        """Apply one batch exactly once. Transient failures are retried; a failure that is
        not transient, or one that keeps repeating on a working connection, isolates the
        message causing it (:meth:`_isolate`) so that no message can stall the consumer."""
        delay = self.config.retry_backoff_s
        started = time.monotonic()
        tries = 0
        while True:
            conn = self._conn
            assert conn is not None
            if self._store is None or self._store.conn is not conn:
                self._store = PostgresStore(conn)
            try:
                result = run_batch(
                    batch, self.codec, self._store, self.config.group_id, self._dlq,
                    read_from=self._read_from, poisoned=poisoned,
                )  # fmt: skip
                break
            except FencedError as exc:
                self._fenced(exc)
                return
            except _RETRYABLE as exc:
                if self._stop.is_set():
                    raise
                tries += 1
                outage = conn.closed or conn.broken or isinstance(exc, DeadLetterError)
                if not outage and tries >= self.config.max_batch_retries:
                    logger.error(
                        "batch of %d failed %d times with %s on a working connection; "
                        "isolating the message that causes it",
                        len(batch), tries, exc,
                    )  # fmt: skip
                    self._isolate(batch, exc, poisoned)
                    return
                metrics.RETRIES.inc()
                self.summary.retries += 1
                logger.warning("batch failed (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.config.retry_backoff_max_s)
                if conn.closed or conn.broken:
                    self._conn = self._connect()
            except Exception as exc:  # not transient: one of its messages may cause it
                if self._stop.is_set() or (conn.closed or conn.broken):
                    raise
                self._isolate(batch, exc, poisoned)
                return
        self._done(result, started)

    def _done(self, result: BatchResult, started: float) -> None:
        """A batch committed: counted, its offsets read on from, and hinted to Kafka."""
        metrics.record_batch(result.plan, time.monotonic() - started)
        self._read_from.update(result.next_offsets)
        self._account(result)
        if self._consumer is not None:
            hint = [TopicPartition(t, p, n) for (t, p), n in result.next_offsets.items()]
            try:
                self._consumer.commit(offsets=hint, asynchronous=True)
            except KafkaException as exc:  # a hint only
                logger.debug("offset hint not committed: %s", exc)

    def _fenced(self, exc: FencedError) -> None:
        logger.warning("batch abandoned: %s", exc)
        metrics.FENCED.inc()
        self.summary.fenced += 1
        self._reseek()

    # ------------------------------------------------------------------ planning ahead
    def _apply_ahead(self, messages: list[Inbound]) -> None:
        """Plan this batch while the one in flight is written, then write it once that one
        has committed (consumer/ahead.py). Whatever goes wrong on this path is left to
        :meth:`_apply`, which applies from the store with its retries and isolation."""
        ahead = self._ahead
        assert ahead is not None
        batch = decode_batch(messages, self.codec)
        try:
            planned = ahead.plan(messages, batch)
            if planned is None:  # it needs the state the batch in flight leaves
                if self._drain() == FENCED:
                    return  # read again after the re-seek
                planned = ahead.plan(messages, batch)
        except Exception as exc:  # the reads' connection, or a message the planner fails on
            logger.debug("planning ahead failed (%s); applying the batch alone", exc)
            reads = self._reads
            if reads is not None and (reads.closed or reads.broken):
                self._reads = self._connect()
                ahead.reader = PostgresStore(self._reads)
            if self._drain() != FENCED:
                self._apply(messages)
            return
        assert planned is not None
        ended = self._drain()
        if ended == FENCED:
            return
        if ended == REDONE:  # planned over a batch that did not commit as planned
            self._apply(messages)
            return
        conn = self._conn
        assert conn is not None
        if self._store is None or self._store.conn is not conn:
            self._store = PostgresStore(conn)
        starts, next_offsets = fence_points(batch, self._read_from)
        ahead.submit(planned, self._store, starts, next_offsets, self._dlq)

    def _drain(self) -> str:
        """Wait for the batch in flight, if any: :data:`CLEAN` when it committed (or none
        was in flight), :data:`REDONE` when it failed and :meth:`_apply` applied it again,
        :data:`FENCED` when it (or its second try) found another consumer owning its
        partitions (they are re-seeked)."""
        flight = self._ahead.take() if self._ahead is not None else None
        if flight is None:
            return CLEAN
        try:
            result = flight.future.result()
        except FencedError as exc:
            self._fenced(exc)
            return FENCED
        except Exception as exc:
            logger.warning("batch written ahead failed (%s); applying it again", exc)
            fenced = self.summary.fenced
            self._apply(list(flight.planned.messages))
            return FENCED if self.summary.fenced > fenced else REDONE
        self._done(result, flight.planned.started)
        return CLEAN

    def _isolate(
        self,
        batch: list[Inbound],
        exc: Exception,
        poisoned: dict[tuple[str, int, int], str] | None,
    ) -> None:
        """Split a failing batch until the message that fails alone is found; that message
        is rejected (``apply_error``, with the error text and its raw bytes) and the rest is
        applied. A message that cannot even be recorded as rejected is a failure of the
        store itself: it is raised."""
        if len(batch) == 1:
            m = batch[0]
            where = (m.topic, m.partition, m.offset)
            if poisoned is not None and where in poisoned:
                raise exc
            logger.error(
                "message %s[%d]@%d cannot be applied (%s: %s); rejecting it as apply_error",
                m.topic, m.partition, m.offset, type(exc).__name__, exc,
            )  # fmt: skip
            metrics.ISOLATED.inc()
            text = f"{type(exc).__name__}: {exc}"[:4000]
            self._apply(batch, {**(poisoned or {}), where: text})
            return
        metrics.SPLITS.inc()
        middle = len(batch) // 2
        self._apply(batch[:middle], poisoned)
        self._apply(batch[middle:], poisoned)

    def _account(self, result: BatchResult) -> None:
        self.summary.add(result.plan)
        # The lag asks the broker for every partition's offsets and the index for its own:
        # ms between one batch's commit and the next one's submission, so at most once per
        # PROGRESS_INTERVAL_S (the final summary has the totals).
        now = time.monotonic()
        if self.progress is not None and now >= self._progress_due:
            self._progress_due = now + PROGRESS_INTERVAL_S
            self.progress(self.summary, self.lag())

    # ------------------------------------------------------------------ offsets
    def _connect(self) -> psycopg.Connection:
        delay = self.config.retry_backoff_s
        while True:
            try:
                return connect(self.config.database_url, autocommit=True)
            except psycopg.OperationalError as exc:
                if self._stop.is_set():
                    raise
                logger.warning("database unavailable (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.config.retry_backoff_max_s)

    def _stored(self) -> dict[int, int]:
        """The offsets the index stored, read on the reads' connection when planning ahead
        (the writer thread may hold the other)."""
        while True:
            reads = self._reads is not None
            conn = self._reads if reads else self._conn
            assert conn is not None
            try:
                return stored_offsets(conn, self.config.group_id, self.config.topic)
            except psycopg.OperationalError as exc:
                if self._stop.is_set():
                    raise
                logger.warning("reading offsets failed (%s); reconnecting", exc)
                time.sleep(self.config.retry_backoff_s)
                if conn.closed or conn.broken:
                    if reads:
                        self._reads = self._connect()
                        if self._ahead is not None:
                            self._ahead.reader = PostgresStore(self._reads)
                    else:
                        self._conn = self._connect()

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drain()
        stored = self._note_deleted(self._stored(), [tp.partition for tp in partitions])
        for tp in partitions:
            tp.offset = stored.get(tp.partition, OFFSET_BEGINNING)
            self._read_from.pop((tp.topic, tp.partition), None)
            if tp.offset >= 0:
                self._read_from[(tp.topic, tp.partition)] = tp.offset
        logger.info(
            "assigned partitions %s", ", ".join(f"{tp.partition}@{tp.offset}" for tp in partitions)
        )
        consumer.assign(partitions)
        self._assigned = frozenset(tp.partition for tp in partitions)
        self._positions = {}

    def _note_deleted(self, stored: dict[int, int], partitions: list[int]) -> dict[int, int]:
        """Records the log no longer holds that this index never read (a stored offset below
        its partition's first: retention deleted them while the consumer was away or
        behind) are recorded and acted on (:mod:`.log_loss`); the stored offsets after."""
        try:
            lost = below_start(self._admin, self.config.topic, stored, partitions)
        except KafkaException as exc:
            logger.warning("could not read the partitions' first offsets: %s", exc)
            return stored
        if not lost:
            return stored
        conn = self._conn
        assert conn is not None
        act_on_losses(conn, self.config.group_id, self.config.topic, stored, lost)
        return self._stored()

    def _on_reset(self, partitions: set[int]) -> None:
        """The client found a partition's position out of the log's range while reading:
        records deleted before they were read are a loss (above); a position past the end
        (the topic made again) starts the partition over, said aloud."""
        self._drain()
        stored = self._note_deleted(self._stored(), sorted(partitions))
        try:
            ends = partition_offsets(self._admin, self.config.topic, partitions=partitions)
        except KafkaException:
            ends = {}
        past = [p for p in partitions if stored.get(p, -1) > ends.get(p, 1 << 62)]
        for p in past:
            logger.error(
                "%s[%d]: the stored offset %d is past the log's end %d (was the topic made "
                "again?); reading the partition from its start", self.config.topic, p,
                stored[p], ends[p],
            )  # fmt: skip
        self._reseek(start_over=set(past))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drain()  # while the partitions are still this consumer's
        logger.info("revoked partitions %s", ", ".join(str(tp.partition) for tp in partitions))
        for tp in partitions:
            self._read_from.pop((tp.topic, tp.partition), None)
            with contextlib.suppress(KeyError):  # no longer ours: another consumer reports it
                metrics.LAG.remove(tp.topic, str(tp.partition))
        consumer.unassign()
        self._assigned, self._positions = frozenset(), {}

    def _reseek(self, start_over: set[int] | None = None) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        stored = self._stored()
        for tp in consumer.assignment():
            offset = stored.get(tp.partition, OFFSET_BEGINNING)
            if start_over and tp.partition in start_over:
                offset = OFFSET_BEGINNING
            self._read_from.pop((tp.topic, tp.partition), None)
            if offset >= 0:
                self._read_from[(tp.topic, tp.partition)] = offset
            try:
                consumer.seek(TopicPartition(tp.topic, tp.partition, offset))
            except KafkaException as exc:
                logger.warning("seek %s[%d] failed: %s", tp.topic, tp.partition, exc)

    def _end_offsets(self) -> dict[int, tuple[int, int]]:
        """(low, high) watermark of every partition of the topic."""
        high = partition_offsets(self._admin, self.config.topic)
        low = partition_offsets(self._admin, self.config.topic, earliest=True, partitions=high)
        return {p: (low.get(p, 0), end) for p, end in high.items()}

    def lag(self) -> int:
        """Messages between the stored offsets and the partitions' ends (-1 if unknown)."""
        try:
            ends = self._end_offsets()
        except KafkaException:
            return -1
        stored = self._read_up_to()
        mine = self._assigned_partitions()
        total = 0
        for partition, (low, high) in ends.items():
            lag = max(0, high - stored.get(partition, low))
            if partition in mine:
                metrics.LAG.labels(self.config.topic, str(partition)).set(lag)
            total += lag
        return total

    def _assigned_partitions(self) -> set[int]:
        return set(self._assigned)

    def _note_positions(self, consumer: Consumer) -> None:
        """The client's positions, from its own thread, between batches (every message read
        so far is applied)."""
        try:
            positions = consumer.position(consumer.assignment())
        except KafkaException:
            return
        self._positions = {tp.partition: tp.offset for tp in positions if tp.offset >= 0}

    def _read_up_to(self) -> dict[int, int]:
        """The stored offsets, moved on to the consumer's position where it has read past
        them: what lies between is no data (a transaction's commit marker, an aborted
        transaction's messages), so a partition that ends with one is still caught up."""
        stored = self._stored()
        for partition, offset in self._positions.items():
            if offset > stored.get(partition, -1):
                stored[partition] = offset
        return stored

    def _reached(self, targets: Mapping[int, int]) -> bool:
        stored = self._read_up_to()
        return all(stored.get(p, 0) >= offset for p, offset in targets.items() if offset > 0)

    def _caught_up(self) -> bool:
        return self.lag() == 0
