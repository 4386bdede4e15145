"""One relay rank's Kafka side: its transactional producer, the open transaction and the
last committed point.

Engine batches go to Kafka in transactions of whole batches. A transaction opens on the
first message after a commit (the announced group specs lead it after a start or an abort),
and commits every ``commit_interval_s`` or ``commit_batches``, or when the engine goes idle.
A commit that fails on a retriable error (the broker away) is retried, the engine left
unread meanwhile; any other failure aborts, and the publisher goes back to the committed
point (epoch and each group's next sequence number) so that the caller can replay the
engine's batches from there.
"""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import KafkaException

from kvledger.producer.config import PublisherConfig
from kvledger.producer.errors import PublishError
from kvledger.producer.publisher import KVEventPublisher
from kvledger.producer.relay.config import RelayConfig
from kvledger.producer.relay.metrics import RelayMetrics
from kvledger.producer.relay.position import PARTITIONER, StreamPosition, recover
from kvledger.schemas.codec import Codec
from kvledger.schemas.topics import misconfigured

logger = logging.getLogger(__name__)
COMMIT_TRY_S = 5.0  # one try of a transaction's commit (retried while the broker is away)


class StoppedError(Exception):
    """Stopped before the broker ever answered."""


class RelayTransactions:
    """A rank's transactional producer (see the module docstring)."""

    def __init__(
        self,
        config: RelayConfig,
        rank: int,
        codec: Codec,
        metrics: RelayMetrics,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.rank = rank
        self.source = config.rank_source(rank)
        self.codec = codec
        self.metrics = metrics
        self._stop = stop
        self.publisher: KVEventPublisher | None = None
        # Where the topic stood when the producer connected (read back from it).
        self.position: StreamPosition | None = None
        # The last engine batch committed, and the publisher's epoch and next sequence
        # numbers at that point.
        self.committed_seq: int | None = None
        self.committed_state: tuple[int, dict[int, int]] = (0, {})
        self.in_txn = 0  # batches (and lost ranges) in the open transaction
        self._open = False
        self._opened_at = 0.0
        self._announce = True

    @property
    def pub(self) -> KVEventPublisher:
        assert self.publisher is not None
        return self.publisher

    @property
    def open(self) -> bool:
        """A transaction is open."""
        return self._open

    def connect(self) -> None:
        """A transactional producer for this source, and the topic's position for it;
        retried until the broker answers (raises :class:`StoppedError` if stopped first)."""
        cfg = self.config
        settings = {
            "message.timeout.ms": 30_000,  # within the transaction's timeout
            "transaction.timeout.ms": 60_000,
            **cfg.kafka,
            "partitioner": PARTITIONER,
            "queue.buffering.max.kbytes": cfg.queue_kbytes,
        }
        pub_config = PublisherConfig(
            bootstrap_servers=cfg.bootstrap_servers,
            source_id=self.source,
            model=cfg.model,
            topic=cfg.topic,
            dp_rank=self.rank,
            kafka=settings,
            heartbeat_interval_s=0,
            surviving_media=cfg.surviving_media,
            reports_reuse=cfg.reports_reuse,
            transactional_id=f"kvledger-relay-{self.source}",
        )
        delay = 0.5
        while not self._stop.is_set():
            publisher = None
            try:
                publisher = KVEventPublisher(pub_config, codec=self.codec)
                publisher.init_transactions(30)
                recover_settings = {**cfg.kafka, "bootstrap.servers": cfg.bootstrap_servers}
                groups = {g.group_idx for g in cfg.groups} | {0}
                position = recover(recover_settings, cfg.topic, self.source, groups, self.codec)
            except (KafkaException, PublishError) as exc:
                if misconfigured(exc):  # retrying cannot help: say so and stop
                    raise
                self.metrics.kafka_paused.labels(self.source).set(1)
                logger.warning(
                    "relay %s: Kafka not ready (%s); retrying in %.1f s", self.source, exc, delay
                )
                if publisher is not None:
                    publisher.close(timeout=1, goodbye=False)
                self._stop.wait(delay)
                delay = min(delay * 2, 10)
                continue
            self.metrics.kafka_paused.labels(self.source).set(0)
            self.publisher = publisher
            self.position = position
            return
        raise StoppedError

    def started(self, engine_seq: int | None) -> None:
        """What the topic holds at start is the committed point."""
        self.committed_seq = engine_seq
        self.committed_state = (self.pub.epoch, self.pub.next_seqs())

    def begin(self) -> None:
        """Open a transaction unless one is open."""
        if self._open:
            return
        pub = self.pub
        pub.begin()
        self._open = True
        self._opened_at = time.monotonic()
        if self._announce:  # at start and after an abort: the specs lead the transaction
            for spec in self.config.groups:
                held = pub.announced(spec.group_idx)
                if held is None:
                    pub.announce_group_spec(spec)
                else:
                    pub.publish_events([held])
            self._announce = False

    def due(self, idle: bool) -> bool:
        """An open transaction that should be committed now."""
        cfg = self.config
        return self._open and (
            idle
            or self.in_txn >= cfg.commit_batches
            or time.monotonic() - self._opened_at >= cfg.commit_interval_s
        )

    def commit(self, last_seq: int | None) -> bool:
        """Commit the open transaction, which ends with engine batch ``last_seq``. Retries
        while the broker is away; on any other failure aborts and returns False (the caller
        replays from :attr:`committed_seq`)."""
        if not self._open:
            return True
        pub = self.pub
        delay = 0.5
        while True:
            try:
                # Short tries: a commit takes milliseconds; one that does not end within a
                # few seconds means the broker is away, and the relay says it is paused.
                pub.commit(COMMIT_TRY_S)
                break
            except (KafkaException, PublishError) as exc:
                retriable = (
                    isinstance(exc, KafkaException)
                    and exc.args
                    and getattr(exc.args[0], "retriable", lambda: False)()
                )
                self.metrics.kafka_paused.labels(self.source).set(1)
                if retriable and not self._stop.is_set():
                    logger.warning(
                        "relay %s: Kafka unreachable, not reading the engine (%s); retrying",
                        self.source,
                        exc,
                    )
                    time.sleep(delay)
                    delay = min(delay * 2, 5)
                    continue
                self.abort(exc)
                return False
        self.metrics.kafka_paused.labels(self.source).set(0)
        self._open = False
        self.in_txn = 0
        self.committed_seq = last_seq
        self.committed_state = (pub.epoch, pub.next_seqs())
        return True

    def abort(self, exc: BaseException) -> None:
        """Abort the open transaction (reconnecting when the producer cannot abort): the
        publisher is back at the committed point."""
        logger.warning(
            "relay %s: transaction failed (%s); it is aborted and batches after %s will be "
            "replayed from the engine once Kafka is back",
            self.source,
            exc,
            self.committed_seq,
        )
        self.metrics.kafka_paused.labels(self.source).set(1)  # until a commit goes through
        try:
            self.pub.abort(30)
        except KafkaException as abort_error:  # a fenced or fatal producer: start over
            logger.warning("relay %s: abort failed (%s); reconnecting", self.source, abort_error)
            try:
                self.pub.close(timeout=1, goodbye=False)
            except (KafkaException, SystemError) as close_error:
                # A fenced producer's flush can fail in the client's C code itself
                # (SystemError: "returned NULL without setting an exception"): what it held
                # is aborted anyway, and the new producer replays it from the engine.
                logger.warning(
                    "relay %s: the failed producer did not close cleanly (%s)",
                    self.source,
                    close_error,
                )
            self.publisher = None
            self._open = False
            self.connect()
        self._open = False
        self.in_txn = 0
        self._announce = True
        epoch, seqs = self.committed_state
        self.pub.resume(epoch, seqs)

    def close(self) -> None:
        if self.publisher is not None:
            try:
                self.publisher.close(timeout=10, goodbye=False)  # not the engine's goodbye
            except PublishError as exc:
                logger.warning("relay %s: closing the producer: %s", self.source, exc)
