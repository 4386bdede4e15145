"""The router index's reader of the log: its Kafka client, the loop's thread, its position.

:class:`Tail` is the part of :class:`~kvledger.serving.router.index.RouterIndex` that
follows the topic from the offsets its bootstrap read: a client of its own assignment of
every partition (no consumer group, no commits), run by the one log loop
(:class:`~kvledger.consumer.loop.LogLoop`) reading promptly (an engine's event reaches a
lookup in milliseconds), the index its sink with its positions in memory (its store's
offsets). :meth:`Tail.position` says where it stands and why it stopped, if it did.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.consumer.inbound import Inbound
from kvledger.consumer.loop import LogLoop, Polled, StopLoop, kafka_consumer, prompt
from kvledger.consumer.store.base import FencedError
from kvledger.schemas.errors import NotAuthorizedError
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topic_check import missing_topic
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, partition_offsets
from kvledger.serving.router.store import RouterStore

logger = logging.getLogger(__name__)

# Why a router stops when its position falls out of the log (retention deleted records it
# had not read: what they said is missing from its memory).
_LOST = (
    "{topic}[{partition}]: records were deleted from the log before this router read them; "
    "it cannot know what they changed: restart it (it bootstraps again from the index, whose "
    "consumer records the loss and ends what it can no longer trust)"
)
# How long a turn waits for the first message (the loop takes what came at once).
TAKE_WAIT_S = 0.2
TOPIC_WAIT_S = 2.0  # how often a router started before its topic looks for it again
# How often position() asks the broker for the log's end (else the last answer stands).
LOG_END_REFRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class Position:
    """Where the router stands in the log."""

    applied: dict[int, int]  # partition -> next offset applied
    log_end: dict[int, int]  # partition -> end offset (last known)
    behind_messages: int
    seconds_behind: float | None  # now minus the log time of the newest applied message
    bootstrapped_in_s: float
    error: str | None = None  # set when the router stopped following the topic
    waiting_for: str | None = None  # what it waits for before it can apply more, if anything


class TailSink:
    """The router's side of the log loop (consumer/loop.py's Client and Sink): the index's
    own client, and the index as the sink. A batch out of place (cannot happen on its own
    assignment) re-seeks; records lost before they were read, or a bug, stop the tail and
    say why in :meth:`Tail.position`."""

    def __init__(self, index: Tail) -> None:
        self.index = index

    @property
    def client(self) -> Consumer:
        assert self.index._consumer is not None
        return self.index._consumer

    def renew(self) -> None:
        index = self.index
        if index._consumer is not None:
            with contextlib.suppress(KafkaException):
                index._consumer.close()
        index._consumer = index._new_client()

    def apply(self, batch: list[Inbound]) -> None:
        index = self.index
        try:
            index.apply(batch)
        except FencedError as exc:
            logger.warning("router batch out of place (%s); re-seeking", exc)
            index._reseek()
            return
        except Exception as exc:  # a bug: stop following, and say so in position()
            logger.exception("router stopped following the topic")
            index.error = f"{type(exc).__name__}: {exc}"
            raise StopLoop from exc
        stamps = [x.timestamp_ms for x in batch if x.timestamp_ms is not None]
        if stamps:
            newest = index._newest_ms
            index._newest_ms = max(stamps + ([newest] if newest else []))

    def lost(self, partitions: set[int]) -> None:
        index = self.index
        index.error = _LOST.format(topic=index.topic, partition=min(partitions))
        logger.error("router stopped following the topic: %s", index.error)
        raise StopLoop

    def turned(self, client: Consumer, polled: Polled) -> bool:
        if not polled.batch:  # idle: everything read is applied
            self.index._note_read_to(client)
            self.index.expire()
        return False


class Tail:
    """The router index's following of the topic (see the module docstring): what the
    index it is part of holds (its settings, its store, :meth:`apply`, :meth:`expire`) is
    :class:`~kvledger.serving.router.index.RouterIndex`'s."""

    bootstrap_servers: str
    topic: str
    consumer_group: str  # whose stored offsets the store carries
    kafka: dict[str, str | int | float | bool]
    batch_size: int
    store: RouterStore
    error: str | None  # why the tail stopped, if it did
    waiting_for: str | None  # what it waits for before it applies more, while it does
    _bootstrap_s: float

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Consumer | None = None
        self._ends: dict[int, int] = {}
        self._waiting_for_topic = False  # started before its topic was made
        self._ends_at = float("-inf")  # when the broker was last asked (monotonic)
        self._ends_lock = threading.Lock()
        self._read_to: dict[int, int] = {}  # the consumer's position when last idle
        self._admin: AdminClient | None = None
        self._newest_ms: int | None = None

    def apply(self, batch: Sequence[Inbound]) -> None:
        """Apply consumed messages, in log order (the index's)."""
        raise NotImplementedError

    def expire(self, force: bool = False) -> int:
        """Forget what is past its retention, when due (the index's)."""
        raise NotImplementedError

    def start(self) -> None:
        """Tail the topic from the bootstrapped offsets in a background thread: the same
        loop as the consumer's (:class:`~kvledger.consumer.loop.LogLoop`), this index its
        sink, reading promptly."""
        self.error = missing_topic(self._client_settings(), self.topic, STARTUP_TIMEOUT_S)
        self._waiting_for_topic = self.error is not None
        if self.error is None:
            self._consumer = self._new_client()
        else:  # said by position() (/healthz: 503) until the topic is made
            logger.error("router: %s; waiting for it", self.error)
        self._thread = threading.Thread(target=self._tail, name="kvledger-router", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._consumer is not None:
            self._consumer.close()

    def loop(self) -> LogLoop:
        """The log's loop, the index's :class:`TailSink` its client's owner and its sink."""
        tail = TailSink(self)
        read = prompt(self.batch_size, TAKE_WAIT_S)
        return LogLoop(self.topic, "the router", tail, read, tail, self._stop)

    def _tail(self) -> None:
        try:
            while self._waiting_for_topic:  # the topic did not exist at start
                if self._stop.wait(TOPIC_WAIT_S):
                    return
                try:
                    why = missing_topic(self._client_settings(), self.topic, STARTUP_TIMEOUT_S)
                except KafkaException as exc:  # the broker away: still waiting
                    self.error = f"waiting for topic {self.topic!r}: {exc}"
                    continue
                if why is None:
                    self._consumer = self._new_client()
                    self.error, self._waiting_for_topic = None, False
                    logger.info("router: topic %s now exists; following it", self.topic)
            self.loop().run()
        except Exception as exc:  # a refusal, or no new client after a fatal error
            refusal = isinstance(exc, NotAuthorizedError)
            self.error = str(exc) if refusal else f"{type(exc).__name__}: {exc}"
            logger.error("router stopped following the topic: %s", self.error)

    def _client_settings(self) -> dict[str, object]:
        return {**self.kafka, "bootstrap.servers": self.bootstrap_servers}

    def _new_client(self) -> Consumer:
        """A client of its own assignment of every partition, at the stored offsets."""
        settings: dict[str, object] = {
            "bootstrap.servers": self.bootstrap_servers,
            "group.id": f"kvledger-router-{uuid.uuid4().hex[:12]}",  # never joins a group
            "auto.offset.reset": "error",  # records lost before it read them: it stops
            "client.id": "kvledger-router",
            "log_level": 4,
        }
        settings.update(self.kafka)
        consumer = kafka_consumer(settings)
        metadata = consumer.list_topics(self.topic, timeout=STARTUP_TIMEOUT_S)
        partitions = sorted(metadata.topics[self.topic].partitions)
        stored = self.store.stored_offsets(self.consumer_group, self.topic)
        consumer.assign(
            [TopicPartition(self.topic, p, stored.get(p, OFFSET_BEGINNING)) for p in partitions]
        )
        return consumer

    def _note_read_to(self, consumer: Consumer) -> None:
        """Idle, everything read is applied: the consumer's position counts as applied
        where it is past the stored offset (only transaction markers or aborted messages
        lie between)."""
        try:
            positions = consumer.position(consumer.assignment())
        except KafkaException:
            return
        self._read_to = {tp.partition: tp.offset for tp in positions if tp.offset >= 0}

    def _applied(self) -> dict[int, int]:
        applied = self.store.stored_offsets(self.consumer_group, self.topic)
        for partition, offset in self._read_to.items():
            if offset > applied.get(partition, -1):
                applied[partition] = offset
        return applied

    def _reseek(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        stored = self.store.stored_offsets(self.consumer_group, self.topic)
        for tp in consumer.assignment():
            offset = stored.get(tp.partition, OFFSET_BEGINNING)
            consumer.seek(TopicPartition(tp.topic, tp.partition, offset))

    def position(self) -> Position:
        """Offsets applied, the log's end (asked of the broker at most once a
        ``LOG_END_REFRESH_S``; the last known one between, or if it does not answer), and
        how far behind that is."""
        applied = self._applied()
        now = time.monotonic()
        # The broker is asked at most once a LOG_END_REFRESH_S, by one caller at a time: a
        # flood of health checks makes no flood of broker requests.
        if now - self._ends_at >= LOG_END_REFRESH_S and self._ends_lock.acquire(blocking=False):
            try:
                self._ends_at = now
                self._ends = self._log_end()
            except KafkaException as exc:
                logger.debug("log end unknown: %s", exc)
            finally:
                self._ends_lock.release()
        behind = sum(max(0, end - applied.get(p, 0)) for p, end in self._ends.items())
        seconds = None
        if self._newest_ms is not None:
            seconds = max(0.0, time.time() - self._newest_ms / 1000)
        return Position(applied, dict(self._ends), behind, seconds, self._bootstrap_s, self.error,
                        self.waiting_for)  # fmt: skip

    def _log_end(self) -> dict[int, int]:
        admin = self._admin
        if admin is None:
            settings: dict[str, str | int | float | bool] = {
                "bootstrap.servers": self.bootstrap_servers
            }
            settings.update(self.kafka)
            admin = self._admin = AdminClient(client_logging(settings))
        return partition_offsets(admin, self.topic)

    def wait_for(self, offsets: dict[int, int], timeout: float = 60.0) -> None:
        """Block until every partition has applied at least ``offsets`` (tests, tools)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            applied = self._applied()
            if all(applied.get(p, 0) >= o for p, o in offsets.items() if o > 0):
                return
            time.sleep(0.05)
        raise TimeoutError(f"router did not reach {offsets} within {timeout} s")
