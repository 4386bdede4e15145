"""The index consumer's batches, applied exactly once: retried, isolated, planned ahead.

:class:`BatchApplier` takes each batch the consumer's loop polled (service.py) and applies it
with :func:`~kvledger.consumer.pipeline.run_batch`: decode, plan and write in one PostgreSQL
transaction with the offsets (its docstring has the commit order). With ``plan_ahead`` (the
default) a batch is planned while the one before it is written (:mod:`.ahead`): the same
transactions in the same order, PostgreSQL's work and the consumer's overlapped.

- A batch that failed on a database or dead-letter error is retried with backoff, on a new
  connection when the old one broke. One whose writer schema must come from a schema
  registry that does not answer waits for it the same way, for as long as it is away (no
  message is at fault: none is rejected).
- One that keeps failing on a working connection, or fails on its own content, is split until
  the message causing it is found; that message is rejected (``apply_error``, with the error
  and its raw bytes) and the rest applied, so that no message can stall the consumer.
- A fenced batch (another consumer holds its partitions now) is abandoned: the consumer
  re-seeks its partitions to the offsets the index stored.

It owns the writer's connection, the reads' connection of planning ahead and the dead-letter
producer; the consumer owns the Kafka client and its assignment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg

from kvledger.consumer import metrics
from kvledger.consumer.ahead import Ahead
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect
from kvledger.consumer.dlq import DeadLetterError, DeadLetterProducer, DeadLetterTopic
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.pipeline import BatchResult, decode_batch, fence_points, run_batch
from kvledger.consumer.store.base import FencedError
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.consumer.summary import RunSummary
from kvledger.schemas.codec import Codec
from kvledger.schemas.registry import RegistryUnavailableError

logger = logging.getLogger(__name__)

_RETRYABLE = (
    psycopg.OperationalError,
    psycopg.errors.SerializationFailure,
    DeadLetterError,
    RegistryUnavailableError,
)
# Services away, not the batch's fault: retried as long as they are, never isolated.
_OUTAGES = (DeadLetterError, RegistryUnavailableError)

# How the batch in flight ended (BatchApplier.drain): committed as planned; failed and
# applied again from the store; fenced (the consumer re-seeked its partitions).
CLEAN, REDONE, FENCED = "clean", "redone", "fenced"

Committed = Callable[[BatchResult, float], None]  # (the result, time.monotonic() it began)
Fenced = Callable[[FencedError], None]


def stored_offsets(conn: psycopg.Connection, group: str, topic: str) -> dict[int, int]:
    """Each partition's next offset for ``group`` as the index stored it."""
    return PostgresStore(conn).stored_offsets(group, topic)


class BatchApplier:
    """Applies the consumer's batches (see the module docstring).

    ``read_from`` is the consumer's own map of where its reading of each partition began
    (its seek, then the end of each batch committed): the batches' fence points. The
    consumer is told of each batch that ``committed`` and of each that was ``fenced``;
    retries are counted in its ``summary``.
    """

    def __init__(  # noqa: PLR0913 - the consumer's parts: config, codec, stop, summary, positions, two callbacks
        self,
        config: ConsumerConfig,
        codec: Codec,
        stop: threading.Event,
        summary: RunSummary,
        read_from: dict[tuple[str, int], int],
        committed: Committed,
        fenced: Fenced,
    ) -> None:
        self.config = config
        self.codec = codec
        self._stop = stop
        self.summary = summary
        self._read_from = read_from
        self._committed = committed
        self._on_fenced = fenced
        self._fences = 0  # batches found fenced (drain() tells by it if a second try was)
        self.conn: psycopg.Connection | None = None  # the writer's
        self._store: PostgresStore | None = None
        # Planning ahead: the reads' connection (loads, stored offsets) beside the writer's
        # (the writer thread's while a batch is in flight).
        self._reads: psycopg.Connection | None = None
        self._ahead: Ahead | None = None
        self.dlq: DeadLetterProducer | None = None

    def open(self) -> psycopg.Connection:
        """The writer's connection (waiting for the database as long as it is away) and the
        dead-letter producer; returns the connection."""
        cfg = self.config
        self.conn = self.connect()
        if cfg.dead_letter_topic:
            topic = DeadLetterTopic(
                cfg.dead_letter_topic,
                cfg.dlq_replication_factor,
                cfg.dlq_topic_config,
                derived=cfg.dlq_topic == "",
            )
            self.dlq = DeadLetterProducer(cfg.bootstrap_servers, topic, settings=cfg.kafka)
        return self.conn

    def plan_ahead(self) -> None:
        """From now on, plan each batch while the one before it is written."""
        self._reads = self.connect()
        self._ahead = Ahead(PostgresStore(self._reads), self.config.group_id)

    def close(self) -> None:
        """Let go of all it holds: the batch planned ahead (committed or not) first."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        if self._reads is not None:
            self._reads.close()
            self._reads = None
        if self.dlq is not None:
            self.dlq.close()
            self.dlq = None
        if self.conn is not None:
            self.conn.close()

    @property
    def busy(self) -> bool:
        """A batch is being written ahead (what has been read is not all applied yet)."""
        return self._ahead is not None and self._ahead.busy

    def apply(self, batch: list[Inbound]) -> None:
        if self._ahead is not None:
            self._apply_ahead(batch)
        else:
            self._apply(batch)

    def connect(self) -> psycopg.Connection:
        """A connection to the index, retried with backoff until stopped."""
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

    def stored(self) -> dict[int, int]:
        """The offsets the index stored, read on the reads' connection when planning ahead
        (the writer thread may hold the other)."""
        while True:
            reads = self._reads is not None
            conn = self._reads if reads else self.conn
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
                        self._reconnect_reads()
                    else:
                        self.conn = self.connect()

    def _reconnect_reads(self) -> None:
        """A new reads' connection, and planning ahead's loads on it."""
        self._reads = self.connect()
        if self._ahead is not None:
            self._ahead.reader = PostgresStore(self._reads)

    def _fenced(self, exc: FencedError) -> None:
        self._fences += 1
        self._on_fenced(exc)

    def _writer(self) -> PostgresStore:
        """The store on the writer's connection (new when the connection is)."""
        conn = self.conn
        assert conn is not None
        if self._store is None or self._store.conn is not conn:
            self._store = PostgresStore(conn)
        return self._store

    # ------------------------------------------------------------------ one at a time
    def _apply(
        self, batch: list[Inbound], poisoned: dict[tuple[str, int, int], str] | None = None
    ) -> None:
        """Apply one batch exactly once. Transient failures are retried; a failure that is
        not transient, or one that keeps repeating on a working connection, isolates the
        message causing it (:meth:`_isolate`)."""
        delay = self.config.retry_backoff_s
        started = time.monotonic()
        tries = 0
        while True:
            store = self._writer()
            conn = store.conn
            try:
                result = run_batch(
                    batch,
                    self.codec,
                    store,
                    self.config.group_id,
                    self.dlq,
                    read_from=self._read_from,
                    poisoned=poisoned,
                )
                break
            except FencedError as exc:
                self._fenced(exc)
                return
            except _RETRYABLE as exc:
                if self._stop.is_set():
                    raise
                tries += 1
                outage = conn.closed or conn.broken or isinstance(exc, _OUTAGES)
                if not outage and tries >= self.config.max_batch_retries:
                    logger.error(
                        "batch of %d failed %d times with %s on a working connection; "
                        "isolating the message that causes it",
                        len(batch),
                        tries,
                        exc,
                    )
                    self._isolate(batch, exc, poisoned)
                    return
                metrics.RETRIES.inc()
                self.summary.retries += 1
                if isinstance(exc, RegistryUnavailableError):
                    logger.warning(
                        "waiting for the schema registry: %s; retrying in %.1f s", exc, delay
                    )
                else:
                    logger.warning("batch failed (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.config.retry_backoff_max_s)
                if conn.closed or conn.broken:
                    self.conn = self.connect()
            except Exception as exc:  # not transient: one of its messages may cause it
                if self._stop.is_set() or (conn.closed or conn.broken):
                    raise
                self._isolate(batch, exc, poisoned)
                return
        self._committed(result, started)

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
                m.topic,
                m.partition,
                m.offset,
                type(exc).__name__,
                exc,
            )
            metrics.ISOLATED.inc()
            text = f"{type(exc).__name__}: {exc}"[:4000]
            self._apply(batch, {**(poisoned or {}), where: text})
            return
        metrics.SPLITS.inc()
        middle = len(batch) // 2
        self._apply(batch[:middle], poisoned)
        self._apply(batch[middle:], poisoned)

    # ------------------------------------------------------------------ planning ahead
    def _apply_ahead(self, messages: list[Inbound]) -> None:
        """Plan this batch while the one in flight is written, then write it once that one
        has committed (consumer/ahead.py). Whatever goes wrong on this path is left to
        :meth:`_apply`, which applies from the store with its retries and isolation."""
        ahead = self._ahead
        assert ahead is not None
        try:
            batch = decode_batch(messages, self.codec)
        except RegistryUnavailableError:  # applied alone, waiting for the registry
            if self.drain() != FENCED:
                self._apply(messages)
            return
        try:
            planned = ahead.plan(messages, batch)
            if planned is None:  # it needs the state the batch in flight leaves
                if self.drain() == FENCED:
                    return  # read again after the re-seek
                planned = ahead.plan(messages, batch)
        except Exception as exc:  # the reads' connection, or a message the planner fails on
            logger.debug("planning ahead failed (%s); applying the batch alone", exc)
            reads = self._reads
            if reads is not None and (reads.closed or reads.broken):
                self._reconnect_reads()
            if self.drain() != FENCED:
                self._apply(messages)
            return
        assert planned is not None
        ended = self.drain()
        if ended == FENCED:
            return
        if ended == REDONE:  # planned over a batch that did not commit as planned
            self._apply(messages)
            return
        starts, next_offsets = fence_points(batch, self._read_from)
        ahead.submit(planned, self._writer(), starts, next_offsets, self.dlq)

    def drain(self) -> str:
        """Wait for the batch in flight, if any: :data:`CLEAN` when it committed (or none
        was in flight), :data:`REDONE` when it failed and was applied again from the store,
        :data:`FENCED` when it (or its second try) found another consumer owning its
        partitions."""
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
            fences = self._fences
            self._apply(list(flight.planned.messages))
            return FENCED if self._fences > fences else REDONE
        self._committed(result, flight.planned.started)
        return CLEAN
