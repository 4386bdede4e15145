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
from dataclasses import dataclass, replace
from typing import Annotated, Literal

import msgspec
from confluent_kafka import OFFSET_END, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.consumer.router.provisional import Decision, Provisional
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, admin_settings, ensure_topic

logger = logging.getLogger(__name__)

# A day: hints matter for seconds, the records until the consumer has written them.
RETENTION_MS = 24 * 3600 * 1000
MAX_RECORD_BYTES = 512 * 1024
# Answers waiting for the log's thread to record them; past this, dropped and counted.
MAX_PENDING_ANSWERS = 10_000
_U64 = (1 << 64) - 1


_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
_Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
_Hex = Annotated[str, msgspec.Meta(min_length=2, max_length=128, pattern="^([0-9a-f]{2})+$")]


class Offer(msgspec.Struct, forbid_unknown_fields=True):
    """One holder the index answered for the prompt: its leading blocks on one tier."""

    instance: _Name
    medium: Annotated[str, msgspec.Meta(max_length=64)]
    ownership: Annotated[str, msgspec.Meta(max_length=512)]
    blocks: _Count
    state: Annotated[str, msgspec.Meta(max_length=16)]


class Record(msgspec.Struct, forbid_unknown_fields=True):
    """A decision as data: its id and time, the prompt's identity (its length in blocks and,
    when it was reported by block hashes, the hashes), what the index offered and what the
    chosen instance had. *Available*: the most leading blocks any live holder had;
    *captured*: what the chosen instance had (on its best tier)."""

    id: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    at: Annotated[float, msgspec.Meta(ge=0, lt=1e11)]  # seconds since the epoch
    block_size: Annotated[int, msgspec.Meta(gt=0, lt=1 << 31)]
    prompt_blocks: _Count
    available_blocks: _Count
    silent_blocks: _Count
    offered: Annotated[list[Offer], msgspec.Meta(max_length=1024)]
    # The chosen instance's state and blocks: None in an answer no choice was reported for.
    chosen_state: Annotated[str, msgspec.Meta(max_length=16)] | None = None
    captured_blocks: _Count | None = None
    available_tier: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    captured_tier: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    captured_hashes: Annotated[list[_Hex], msgspec.Meta(max_length=65_536)] | None = None
    first_hash: _Hex | None = None  # the prompt's, when reported by hashes
    last_hash: _Hex | None = None


@dataclass(frozen=True, slots=True)
class Answered:
    """An answer the service gave (Dynamo's ``/query``) for which no router reported the
    instance it chose: recorded with what was offered, never held."""

    model: str
    group_idx: int
    origin: str = ""
    request_id: str | None = None


class _Wire(msgspec.Struct, forbid_unknown_fields=True):
    v: Literal[1, 2, 3]
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    group_idx: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    origin: Annotated[str, msgspec.Meta(max_length=64)]
    instance: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    kind: Literal["tokens", "hashes"] | None = None
    keys: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=65_536)] = []
    request_id: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    record: Record | None = None


_decode = msgspec.json.Decoder(_Wire).decode
_encode = msgspec.json.Encoder().encode


def encode(d: Decision | Answered, record: Record | None = None) -> bytes:
    if isinstance(d, Answered):
        if record is None:
            raise ValueError("an answer is recorded with what it offered")
        return _encode(_Wire(3, d.model, d.group_idx, d.origin, request_id=d.request_id,
                             record=record))  # fmt: skip
    return _encode(_Wire(1 if record is None else 2, d.model, d.group_idx, d.origin,
                         d.instance, d.kind, list(d.keys), d.request_id, record))  # fmt: skip


def decode(raw: bytes) -> Decision | Answered:
    """A record's decision (or answer); ``ValueError`` saying why it is neither."""
    return decode_record(raw)[0]


def decode_record(raw: bytes) -> tuple[Decision | Answered, Record | None]:
    """A record's decision (or, version 3, answer) and, from version 2, what was offered;
    ``ValueError`` saying why it is not one."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        w = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(str(exc)) from None
    if (w.v == 1) != (w.record is None):
        raise ValueError(f"v {w.v} with{'out' if w.record is None else ''} a record")
    if w.v == 3:
        if w.instance is not None or w.kind is not None or w.keys:
            raise ValueError("v 3 (an answer) names no instance, kind or keys")
        if w.record is not None and (w.record.chosen_state is not None
                                     or w.record.captured_blocks is not None):  # fmt: skip
            raise ValueError("v 3 (an answer) has no chosen_state or captured_blocks")
        return Answered(w.model, w.group_idx, w.origin, w.request_id), w.record
    if w.instance is None or w.kind is None:
        raise ValueError(f"v {w.v} without {'instance' if w.instance is None else 'kind'}")
    if w.record is not None and (w.record.chosen_state is None
                                 or w.record.captured_blocks is None):  # fmt: skip
        raise ValueError(f"v {w.v} without the record's chosen_state or captured_blocks")
    if w.keys and max(w.keys) > _U64:
        raise ValueError("a key over 2^64-1")
    decision = Decision(w.model, w.group_idx, w.instance, w.kind, tuple(w.keys), w.origin,
                        w.request_id)  # fmt: skip
    return decision, w.record


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
