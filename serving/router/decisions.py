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
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from confluent_kafka import OFFSET_END, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.schemas.decisions import Answered, Decision, Record, decode, encode
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, admin_settings, ensure_topic
from kvledger.serving.router.provisional import Provisional

logger = logging.getLogger(__name__)

# A day: hints matter for seconds, the records until the consumer has written them.
RETENTION_MS = 24 * 3600 * 1000
# Answers waiting for the log's thread to record them; past this, dropped and counted.
MAX_PENDING_ANSWERS = 10_000


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
        self.settings: dict[str, object] = {"bootstrap.servers": bootstrap_servers,
                                            **(kafka or {})}  # fmt: skip
        self.origin = uuid.uuid4().hex[:16]  # this replica, in the records it writes
        self.shared = 0  # others' decisions held
        self.rejected = 0  # records that were not decisions
        self.dropped = 0  # own decisions not written (the producer's queue was full)
        # Answers to record, each with what builds its record (off the lookup's path).
        self._answers: deque[tuple[Answered, Callable[[], Record]]] = deque()
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned = 0.0

    def start(self) -> None:
        admin = AdminClient(admin_settings(self.settings))
        # Any retention will do for hints kept seconds: only a topic made here gets an hour's.
        ensure_topic(admin, self.topic, partitions=1, exact_partitions=False,
                     config={"retention.ms": str(RETENTION_MS)},
                     timeout=STARTUP_TIMEOUT_S)  # fmt: skip
        self._producer = Producer(client_logging({
            **self.settings, "linger.ms": 0, "acks": 1, "enable.idempotence": False,
            "queue.buffering.max.messages": 100_000, "message.timeout.ms": 5000,
            "client.id": "kvledger-decisions",
        }))  # fmt: skip
        consumer = Consumer(client_logging({
            **self.settings, "group.id": f"kvledger-decisions-{self.origin}",  # joins none
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": "latest", "fetch.wait.max.ms": 10, "client.id":
            "kvledger-decisions", "log_level": 4,
        }))  # fmt: skip
        metadata = consumer.list_topics(self.topic, timeout=STARTUP_TIMEOUT_S)
        since = int((time.time() - self.provisional.ttl_s) * 1000)
        partitions = metadata.topics[self.topic].partitions
        wanted = [TopicPartition(self.topic, p, since) for p in partitions]
        found = consumer.offsets_for_times(wanted, timeout=STARTUP_TIMEOUT_S)
        consumer.assign([TopicPartition(tp.topic, tp.partition,
                                        tp.offset if tp.offset >= 0 else OFFSET_END)
                         for tp in found])  # fmt: skip
        self._consumer = consumer
        self._thread = threading.Thread(target=self._tail, name="kvledger-decisions",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def publish(self, decision: Decision | Answered, record: Record | None = None) -> None:
        """Write ``decision`` (and what was offered) for the other replicas and the
        consumer; never waits (a full queue drops it, counted and logged)."""
        assert self._producer is not None
        try:
            wire = encode(replace(decision, origin=self.origin), record)
            self._producer.produce(self.topic, wire)
        except BufferError:
            self.dropped += 1
            self._warn("decisions topic %s: the producer's queue is full; %d decisions not "
                       "shared", self.topic, self.dropped)  # fmt: skip
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
        consumer = self._consumer
        assert consumer is not None
        while not self._stop.is_set():
            self._record_answers()
            first = consumer.poll(0.1)  # at once when one comes (consume() waits for all)
            if first is None:
                continue
            for msg in [first, *consumer.consume(499, 0)]:
                err = msg.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        self._warn("decisions topic %s: %s", self.topic, err)
                    continue
                try:
                    decision = decode(msg.value() or b"")
                except ValueError as exc:
                    self.rejected += 1
                    self._warn("decisions topic %s: record at partition %d offset %d is not "
                               "a decision (%s); skipped", self.topic, msg.partition(),
                               msg.offset(), exc)  # fmt: skip
                    continue
                if isinstance(decision, Decision) and decision.origin != self.origin:
                    self.provisional.add(decision)
                    self.shared += 1
            if self._producer is not None:
                self._producer.poll(0)

    def _warn(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned >= 1.0:  # at most a line a second
            self._warned = now
            logger.warning(fmt, *args)
