"""The index consumer's Kafka side: the client's lifecycle around the batch pipeline.

:meth:`IndexConsumer.run` polls up to ``batch_size`` messages (or ``batch_timeout_s``) and
hands them to :class:`~kvledger.consumer.applier.BatchApplier`, which applies each exactly
once (in one transaction with the offsets, retried, isolated, planned ahead: its docstring);
then its loop commits the offsets to Kafka only as a hint for lag tools (auto-commit is
off): the consumer is a :class:`~kvledger.consumer.loop.TransactionSink`.

What stays here: assignment (seek to the offsets stored in PostgreSQL, so a crash at any
instant neither loses nor double-applies a message), error triage (a fatal client error
starts a new client), re-seeking after a fenced batch, records the log lost, lag.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import start_http_server

from kvledger.consumer import metrics
from kvledger.consumer.applier import BatchApplier
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.log_loss import act_on_losses, below_start
from kvledger.consumer.loop import LogLoop, Polled, filled, kafka_consumer
from kvledger.consumer.pipeline import BatchResult
from kvledger.consumer.retention import Retainer, ensure_partitions
from kvledger.consumer.store.base import FencedError
from kvledger.consumer.summary import RunSummary
from kvledger.schemas.codec import Codec
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import admin_settings, partition_offsets

logger = logging.getLogger(__name__)


ProgressFn = Callable[[RunSummary, int], None]
# How often a consumer with a progress function reports (and reads its lag).
PROGRESS_INTERVAL_S = 1.0


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
        # Where this consumer's reading of each partition began: its seek, then the end of
        # each batch it applied (the batches' fence points).
        self._read_from: dict[tuple[str, int], int] = {}
        self._batches = BatchApplier(
            config, self.codec, self._stop, self.summary, self._read_from, self._done, self._fenced
        )
        # The next offsets of the batches committed since the loop last hinted them to Kafka
        # (batches commit on the writer's thread too).
        self._hints: dict[tuple[str, int], int] = {}
        self._hints_lock = threading.Lock()
        self._consumer: Consumer | None = None
        # The client's assignment and read positions as its own thread last saw them: other
        # threads (lag(), a demo's progress) read these, never the client, whose calls
        # wait on one another (a consume() of the loop would starve them).
        self._assigned: frozenset[int] = frozenset()
        self._positions: dict[int, int] = {}
        settings = {
            **admin_settings(config.kafka),
            "bootstrap.servers": config.bootstrap_servers,
            "log_level": 4,
        }
        self._admin = AdminClient(client_logging(settings))

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
        retainer = None
        try:
            conn = self._batches.open()
            self._consumer = self._new_consumer()
            if cfg.retention is not None:  # its first pass makes the partitions ahead
                retainer = Retainer(cfg.database_url, cfg.retention, cfg.retention_every_s)
                retainer.start()
            else:
                ensure_partitions(conn)
            if cfg.plan_ahead:
                self._batches.plan_ahead()
            loop = self.loop()
            loop.run()
            self._batches.drain()
            loop.hint()
        finally:
            self.summary.seconds = time.monotonic() - started
            self._batches.close()  # what it holds ends, committed or not, first
            if retainer is not None:
                retainer.stop()
            if self._consumer is not None:
                self._consumer.close()
        return self.summary

    def loop(self) -> LogLoop:
        """The log's loop, this consumer its client's owner and its sink. Batches are
        filled (each is a PostgreSQL transaction): a busy topic's stay large."""
        cfg = self.config
        return LogLoop(
            cfg.topic,
            f"the consumer of group {cfg.group_id!r}",
            self,
            filled(cfg.batch_size, cfg.batch_timeout_s),
            self,
            self._stop,
            cfg.stop_at,
            needs=f" and READ on group {cfg.group_id!r}",
        )

    # The loop's client owner and sink (consumer/loop.py's Client and TransactionSink).
    @property
    def client(self) -> Consumer:
        assert self._consumer is not None
        return self._consumer

    def renew(self) -> None:
        self._batches.drain()
        self._recreate_consumer()

    def apply(self, batch: list[Inbound]) -> None:
        self._batches.apply(batch)

    def lost(self, partitions: set[int]) -> None:
        self._on_reset(partitions)

    def turned(self, client: Consumer, polled: Polled) -> bool:
        cfg = self.config
        # A turn that did not hand over a full batch has nothing more to overlap: the batch
        # in flight is waited for, so an idle or stopping consumer has applied all it read.
        if len(polled.batch) < cfg.batch_size:
            self._batches.drain()
        if not self._batches.busy:
            self._note_positions(client)  # all it read is applied now
        if cfg.stop_at is not None and self._reached(cfg.stop_at):
            return True
        return bool(cfg.until_caught_up and polled.received < cfg.batch_size and self._caught_up())

    def committed(self) -> dict[tuple[str, int], int]:
        with self._hints_lock:
            hints, self._hints = self._hints, {}
        return hints

    def _new_consumer(self) -> Consumer:
        cfg = self.config
        settings: dict[str, object] = {
            "bootstrap.servers": cfg.bootstrap_servers,
            "group.id": cfg.group_id,
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
        consumer = kafka_consumer(settings)
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

    def _done(self, result: BatchResult, started: float) -> None:
        """A batch committed: counted, its offsets read on from, and kept for the loop to
        hint to Kafka."""
        metrics.record_batch(result.plan, time.monotonic() - started)
        self._read_from.update(result.next_offsets)
        with self._hints_lock:
            self._hints.update(result.next_offsets)
        self._account(result)

    def _fenced(self, exc: FencedError) -> None:
        """A batch was abandoned: another consumer holds its partitions now."""
        logger.warning("batch abandoned: %s", exc)
        metrics.FENCED.inc()
        self.summary.fenced += 1
        self._reseek()

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
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._batches.drain()
        stored = self._note_deleted(self._batches.stored(), [tp.partition for tp in partitions])
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
        conn = self._batches.conn
        assert conn is not None
        act_on_losses(conn, self.config.group_id, self.config.topic, stored, lost)
        return self._batches.stored()

    def _on_reset(self, partitions: set[int]) -> None:
        """The client found a partition's position out of the log's range while reading:
        records deleted before they were read are a loss (above); a position past the end
        (the topic made again) starts the partition over, said aloud."""
        self._batches.drain()
        stored = self._note_deleted(self._batches.stored(), sorted(partitions))
        try:
            ends = partition_offsets(self._admin, self.config.topic, partitions=partitions)
        except KafkaException:
            ends = {}
        past = [p for p in partitions if stored.get(p, -1) > ends.get(p, 1 << 62)]
        for p in past:
            logger.error(
                "%s[%d]: the stored offset %d is past the log's end %d (was the topic made "
                "again?); reading the partition from its start",
                *(self.config.topic, p, stored[p], ends[p]),
            )
        self._reseek(start_over=set(past))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._batches.drain()  # while the partitions are still this consumer's
        logger.info("revoked partitions %s", ", ".join(str(tp.partition) for tp in partitions))
        for tp in partitions:
            self._read_from.pop((tp.topic, tp.partition), None)
            with self._hints_lock:  # another consumer's to hint now
                self._hints.pop((tp.topic, tp.partition), None)
            with contextlib.suppress(KeyError):  # no longer ours: another consumer reports it
                metrics.LAG.remove(tp.topic, str(tp.partition))
        consumer.unassign()
        self._assigned, self._positions = frozenset(), {}

    def _reseek(self, start_over: set[int] | None = None) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        stored = self._batches.stored()
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
        stored = self._batches.stored()
        for partition, offset in self._positions.items():
            if offset > stored.get(partition, -1):
                stored[partition] = offset
        return stored

    def _reached(self, targets: Mapping[int, int]) -> bool:
        stored = self._read_up_to()
        return all(stored.get(p, 0) >= offset for p, offset in targets.items() if offset > 0)

    def _caught_up(self) -> bool:
        return self.lag() == 0
