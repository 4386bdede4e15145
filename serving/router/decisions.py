"""Routing decisions shared by every replica of the lookup service through one Kafka topic.

A replica that takes a decision report holds it at once (:class:`.provisional.Provisional`)
and writes it here; every replica reads the topic from the start of the provisional window
and holds the decisions the others took. The topic is a hint channel, not a log of record:
a decision lost on the way costs one lookup's freshness, never the index's truth, so it is
written without transactions and read without a consumer group. A record that does not
read as a decision is skipped, counted and logged with its partition and offset.

The wire form is JSON: ``{"v": 1, "model", "group_idx", "instance", "kind": "tokens" |
"hashes", "keys": [u64...], "origin", "request_id"?}``; the keys are the prompt's chained
block keys (:func:`.provisional.token_keys`), never its tokens. Version 2 adds ``record``
(:class:`Record`): what the index offered when the decision was taken, which the consumer
keeps in PostgreSQL (consumer/decision_records.py) for the funnel of available, captured
and delivered reuse. Version 3 is an answer no router reported a choice for (Dynamo's
``/query``): ``{"v": 3, "model", "group_idx", "origin", "record"}``, recorded for the funnel,
never held. Replicas read every version.

The log reads on the one log loop (:class:`~kvledger.consumer.loop.LogLoop`), its client's
owner and its sink, reading promptly; its positions live in memory (a new client after a
fatal error reads on from them), and between turns its thread records the answers noted
and serves the producer's callbacks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from confluent_kafka import OFFSET_END, Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.consumer.inbound import Inbound
from kvledger.consumer.loop import LogLoop, Polled, kafka_consumer, prompt
from kvledger.schemas.decisions import Answered, Decision, Record, decode, encode
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, admin_settings, ensure_topic
from kvledger.serving.router.provisional import Provisional

logger = logging.getLogger(__name__)

# A day: hints matter for seconds, the records until the consumer has written them.
RETENTION_MS = 24 * 3600 * 1000
# Answers waiting for the log's thread to record them; past this, dropped and counted.
MAX_PENDING_ANSWERS = 10_000
# Records read per turn, and how long a turn waits for the first.
READ_LIMIT, READ_WAIT_S = 500, 0.1
# How long the thread waits after its loop failed (a refusal, no new client) to start again.
RESTART_S = 2.0


class DecisionLog:
    """Writes this replica's decisions to ``topic`` and holds every other replica's in
    ``provisional``: started with :meth:`start` (which creates the topic if missing, or
    fails saying why), stopped with :meth:`stop`."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        provisional: Provisional,
        kafka: dict[str, object] | None = None,
    ) -> None:
        self.topic, self.provisional = topic, provisional
        self.settings: dict[str, object] = {"bootstrap.servers": bootstrap_servers, **(kafka or {})}
        self.origin = uuid.uuid4().hex[:16]  # this replica, in the records it writes
        self.shared = 0  # others' decisions held
        self.rejected = 0  # records that were not decisions
        self.dropped = 0  # own decisions not written (the producer's queue was full)
        # Answers to record, each with what builds its record (off the lookup's path).
        self._answers: deque[tuple[Answered, Callable[[], Record]]] = deque()
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._next: dict[int, int] = {}  # partition -> the next offset to read (memory)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned = 0.0

    def start(self) -> None:
        admin = AdminClient(admin_settings(self.settings))
        # Any retention will do for hints kept seconds: only a topic made here gets an hour's.
        config = {"retention.ms": str(RETENTION_MS)}
        ensure_topic(
            admin,
            self.topic,
            partitions=1,
            exact_partitions=False,
            config=config,
            timeout=STARTUP_TIMEOUT_S,
        )
        self._producer = Producer(
            client_logging(
                {
                    **self.settings,
                    "linger.ms": 0,
                    # Idempotent, every replica acknowledging: a retried send is never a
                    # second record (the recorder also drops a decision id it holds).
                    "acks": "all",
                    "enable.idempotence": True,
                    "queue.buffering.max.messages": 100_000,
                    "message.timeout.ms": 5000,
                    "client.id": "kvledger-decisions",
                }
            )
        )
        self._consumer = self._new_client()
        self._thread = threading.Thread(target=self._tail, name="kvledger-decisions", daemon=True)
        self._thread.start()

    def _new_client(self) -> Consumer:
        """A client of its own assignment of every partition: where this log read up to,
        else from the start of the provisional window (or the end)."""
        consumer = kafka_consumer(
            {
                **self.settings,
                "group.id": f"kvledger-decisions-{self.origin}",  # joins none
                "auto.offset.reset": "latest",
                "fetch.wait.max.ms": 10,
                "client.id": "kvledger-decisions",
                "log_level": 4,
            }
        )
        metadata = consumer.list_topics(self.topic, timeout=STARTUP_TIMEOUT_S)
        since = int((time.time() - self.provisional.ttl_s) * 1000)
        partitions = metadata.topics[self.topic].partitions
        wanted = [TopicPartition(self.topic, p, since) for p in partitions if p not in self._next]
        found = consumer.offsets_for_times(wanted, timeout=STARTUP_TIMEOUT_S) if wanted else []
        at = [TopicPartition(self.topic, p, n) for p, n in self._next.items() if p in partitions]
        at += [
            TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_END)
            for tp in found
        ]
        consumer.assign(at)
        return consumer

    def loop(self) -> LogLoop:
        """The log's loop, this log its client's owner and its sink, reading promptly."""
        return LogLoop(
            self.topic, "the decision log", self, prompt(READ_LIMIT, READ_WAIT_S), self, self._stop
        )

    def publish(self, decision: Decision | Answered, record: Record | None = None) -> None:
        """Write ``decision`` (and what was offered) for the other replicas and the
        consumer; never waits (a full queue drops it, counted and logged)."""
        assert self._producer is not None
        try:
            wire = encode(replace(decision, origin=self.origin), record)
            self._producer.produce(self.topic, wire)
        except BufferError:
            self.dropped += 1
            self._warn(
                "decisions topic %s: the producer's queue is full; %d decisions not shared",
                self.topic,
                self.dropped,
            )
        self._producer.poll(0)

    def note_answer(self, answered: Answered, build: Callable[[], Record]) -> None:
        """Record an answer no choice was reported for: ``build`` makes its record on the
        log's thread, so the lookup that gave it pays an append (a full queue drops it,
        counted as a decision not written)."""
        if len(self._answers) >= MAX_PENDING_ANSWERS:
            self.dropped += 1
            return
        self._answers.append((answered, build))

    def _record_answers(self) -> None:
        while self._answers:
            answered, build = self._answers.popleft()
            try:
                record = build()
            except Exception as exc:  # one answer's record; the log goes on
                self.dropped += 1
                self._warn("decisions topic %s: an answer not recorded (%s)", self.topic, exc)
                continue
            self.publish(answered, record)

    def stop(self) -> None:
        """Stop tailing; the answers still waiting for the thread are recorded first and
        every record written is flushed (the HTTP server has stopped: none come after)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._consumer is not None:
            self._consumer.close()
        if self._producer is not None:
            self._record_answers()  # noted since the thread's last pass
            self._producer.flush(2)

    def _tail(self) -> None:
        while not self._stop.is_set():
            try:
                if self._consumer is None:  # the last new client failed
                    self._consumer = self._new_client()
                self.loop().run()
            except Exception as exc:  # a hint channel outlives any one fault
                self._warn(
                    "decisions topic %s: %s; reading again in %.0f s", self.topic, exc, RESTART_S
                )
                self._stop.wait(RESTART_S)

    # The loop's client owner and sink (consumer/loop.py's Client and Sink: positions in
    # memory).
    @property
    def client(self) -> Consumer:
        assert self._consumer is not None
        return self._consumer

    def renew(self) -> None:
        """A fatal client error: a new client, from where this log read up to."""
        if self._consumer is not None:
            try:
                self._consumer.close()
            except KafkaException as exc:
                self._warn("decisions topic %s: closing the failed client: %s", self.topic, exc)
        self._consumer = None
        self._consumer = self._new_client()

    def apply(self, batch: list[Inbound]) -> None:
        """Hold the other replicas' decisions; skip (counted, logged) what is not one."""
        for msg in batch:
            self._next[msg.partition] = msg.offset + 1
            try:
                decision = decode(msg.value)
            except ValueError as exc:
                self.rejected += 1
                self._warn(
                    "decisions topic %s: record at partition %d offset %d is not "
                    "a decision (%s); skipped",
                    self.topic,
                    msg.partition,
                    msg.offset,
                    exc,
                )
                continue
            if isinstance(decision, Decision) and decision.origin != self.origin:
                self.provisional.add(decision)
                self.shared += 1

    def lost(self, partitions: set[int]) -> None:
        """Hints deleted before they were read: a lookup's freshness, never the index's."""
        self._warn(
            "decisions topic %s: partitions %s fell out of the log's range",
            self.topic,
            sorted(partitions),
        )

    def turned(self, client: Consumer, polled: Polled) -> bool:
        self._record_answers()
        if self._producer is not None:
            self._producer.poll(0)
        return False

    def _warn(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned >= 1.0:  # at most a line a second
            self._warned = now
            logger.warning(fmt, *args)
