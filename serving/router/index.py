"""RouterIndex: prefix lookups from memory, with the durable index's answers.

1. :meth:`RouterIndex.bootstrap` reads one consistent snapshot of the PostgreSQL index —
   group specs, the blocks lookups need, live residencies, source states and lives, and the
   consumer group's stored offsets — in one REPEATABLE READ transaction (:mod:`.snapshot`).
2. :meth:`RouterIndex.start` tails the topic from exactly those offsets (its own
   assignment of every partition, no consumer-group commits) through the same pipeline and
   pure core as the consumer (its commonest events in one native call each: :mod:`.lane`),
   into the :class:`RouterStore`: no gap, no double count, the same rejections.
3. :meth:`match`, :meth:`match_tokens` (and :func:`~kvledger.serving.lookup.rank`) answer
   as the SQL functions do at the same log position; :meth:`position` says which.

Any number of routers can run: each is an independent reader of the log.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.consumer import metrics
from kvledger.consumer.core.model import (
    GroupKey,
)
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.loop import LogLoop, Polled, StopLoop, take
from kvledger.consumer.retention_policy import Retention, show_duration
from kvledger.consumer.store.base import FencedError
from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import NotAuthorizedError
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.lookup import EngineLoad, Holder
from kvledger.schemas.topics import STARTUP_TIMEOUT_S, partition_offsets
from kvledger.serving.lookup.api import Granularity, deepest_states
from kvledger.serving.router import match as m
from kvledger.serving.router.lane import LaneObserver, run_router_batch
from kvledger.serving.router.snapshot import load_snapshot
from kvledger.serving.router.store import RouterStore

logger = logging.getLogger(__name__)


# Why a router stops when its position falls out of the log (retention deleted records it
# had not read: what they said is missing from its memory).
_LOST = (
    "{topic}[{partition}]: records were deleted from the log before this router read them; "
    "it cannot know what they changed: restart it (it bootstraps again from the index, whose "
    "consumer records the loss and ends what it can no longer trust)"
)
# Messages applied per hold of the lock lookups take (see _tail).
APPLY_CHUNK = 500
# How often position() asks the broker for the log's end (else the last answer stands).
LOG_END_REFRESH_S = 1.0
# How long a router keeps a block no one holds (as the index keeps its block rows).
BLOCK_RETENTION = Retention().blocks
# Rows an expiry pass looks at per hold of the lookups' lock (~1 ms natively).
EXPIRY_SLICE = 200_000


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector paused while one chunk applies.

    The pipeline makes no reference cycles (its temporaries go by reference count: a
    collection during the tail benchmark found nothing to collect), yet a chunk's
    short-lived objects trigger full collections, each walking every tracked object of the
    process: about 30% of the apply time, measured. Cycles made meanwhile, by anyone, are
    still collected once it is back on (after ~10 ms). A process that keeps the collector off
    keeps it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass(frozen=True, slots=True)
class Position:
    """Where the router stands in the log."""

    applied: dict[int, int]  # partition -> next offset applied
    log_end: dict[int, int]  # partition -> end offset (last known)
    behind_messages: int
    seconds_behind: float | None  # now minus the log time of the newest applied message
    bootstrapped_in_s: float
    error: str | None = None  # set when the router stopped following the topic


class ApplyObserver(LaneObserver, Protocol):
    """A :class:`LaneObserver` also told when each chunk has applied (under the lookups'
    lock, so it reads the store as the chunk left it)."""

    def applied(self) -> None: ...


class _Tail:
    """The router's side of the log loop (consumer/loop.py's Client and Sink): the index's
    own client, and the index as the sink. A batch out of place (cannot happen on its own
    assignment) re-seeks; records lost before they were read, or a bug, stop the tail and
    say why in :meth:`RouterIndex.position`."""

    def __init__(self, index: RouterIndex) -> None:
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


class RouterIndex:
    """The in-memory router index (see the module docstring)."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str = "kv-events",
        consumer_group: str = "kvledger-index",
        kafka: dict[str, str | int | float | bool] | None = None,
        batch_size: int = 5000,
        codec: Codec | None = None,
        dynamo: bool = False,
        block_retention: timedelta | None = BLOCK_RETENTION,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.consumer_group = consumer_group  # whose stored offsets the snapshot carries
        self.kafka = dict(kafka or {})
        self.batch_size = batch_size
        self.dynamo = dynamo  # keep Dynamo's block hashes too (its API: lookup/dynamo.py)
        self.store = RouterStore(dynamo)
        self.codec = codec or Codec()
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Consumer | None = None
        self._ends: dict[int, int] = {}
        self._ends_at = float("-inf")  # when the broker was last asked (monotonic)
        self._ends_lock = threading.Lock()
        self._read_to: dict[int, int] = {}  # the consumer's position when last idle
        self._admin: AdminClient | None = None
        self._newest_ms: int | None = None
        self._bootstrap_s = 0.0
        self.applied_messages = 0
        self.block_events = 0
        self.error: str | None = None  # why the tail stopped, if it did
        # A block no one holds or names as its parent is forgotten this long after it was
        # last stored or held (None: never), checked every tenth of it (1 s to 60 s).
        self.block_retention = block_retention
        self._next_expiry = 0.0
        self.blocks_expired = 0
        self.observer: ApplyObserver | None = None  # told what each chunk applied

    # ------------------------------------------------------------------ bootstrap
    def bootstrap(self, conn: psycopg.Connection) -> None:
        """Load one consistent snapshot of the PostgreSQL index (and its offsets)."""
        started = time.perf_counter()
        store = load_snapshot(conn, self.consumer_group, self.topic, self.dynamo, _clock())
        with self.lock:
            self.store = store
        self._bootstrap_s = time.perf_counter() - started
        logger.info(
            "router bootstrapped in %.1f s: %d blocks, %d holders, offsets %s",
            self._bootstrap_s,
            sum(len(g) for g in store.groups.values()),
            len(store.holders),
            self.store.stored_offsets(self.consumer_group, self.topic),
        )

    # ------------------------------------------------------------------ tailing
    def start(self) -> None:
        """Tail the topic from the bootstrapped offsets in a background thread: the same
        loop as the consumer's (:class:`~kvledger.consumer.loop.LogLoop`), this index its
        sink, reading promptly."""
        self._consumer = self._new_client()
        self._thread = threading.Thread(target=self._tail, name="kvledger-router", daemon=True)
        self._thread.start()

    def _new_client(self) -> Consumer:
        """A client of its own assignment of every partition, at the stored offsets."""
        settings: dict[str, object] = {
            "bootstrap.servers": self.bootstrap_servers,
            "group.id": f"kvledger-router-{uuid.uuid4().hex[:12]}",  # never joins a group
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "error",  # records lost before it read them: it stops
            "client.id": "kvledger-router",
            "log_level": 4,
        }
        settings.update(self.kafka)
        consumer = Consumer(client_logging(settings))
        metadata = consumer.list_topics(self.topic, timeout=STARTUP_TIMEOUT_S)
        partitions = sorted(metadata.topics[self.topic].partitions)
        stored = self.store.stored_offsets(self.consumer_group, self.topic)
        consumer.assign(
            [TopicPartition(self.topic, p, stored.get(p, OFFSET_BEGINNING)) for p in partitions]
        )
        return consumer

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._consumer is not None:
            self._consumer.close()

    def _tail(self) -> None:
        tail = _Tail(self)
        loop = LogLoop(
            self.topic, "the router", tail,
            lambda client: take(client, self.batch_size, 0.2), tail, self._stop,
        )  # fmt: skip
        try:
            loop.run()
        except Exception as exc:  # a refusal, or no new client after a fatal error
            self.error = str(exc) if isinstance(exc, NotAuthorizedError) else (
                f"{type(exc).__name__}: {exc}"
            )  # fmt: skip
            logger.error("router stopped following the topic: %s", self.error)

    def apply(self, batch: Sequence[Inbound]) -> None:
        """Apply consumed messages, in log order, through the pipeline into the store.

        In chunks of :data:`APPLY_CHUNK` under the lookups' lock, so a lookup waits for one
        chunk at most (~10 ms), never for a whole poll's worth of messages."""
        for i in range(0, len(batch), APPLY_CHUNK):
            with self.lock, collector_paused():
                # The router is its store's only writer: its reading began where the
                # store's offsets stand (past any transaction marker between batches).
                read_from = {
                    (self.topic, p): o
                    for p, o in self.store.stored_offsets(self.consumer_group, self.topic).items()
                }
                self.store.set_clock(_clock())
                tally = run_router_batch(
                    batch[i : i + APPLY_CHUNK], self.codec, self.store, self.consumer_group,
                    read_from=read_from, observer=self.observer,
                )  # fmt: skip
                if self.observer is not None:
                    self.observer.applied()
            self.applied_messages += tally.messages
            self.block_events += tally.block_events
        self.expire()

    def expire(self, force: bool = False) -> int:
        """Forget the blocks past the block retention (see :meth:`RouterStore.expire_slices`),
        when a check is due (or ``force``); how many went. Bounds the router's memory as
        the index's own retention bounds its block rows: without it, every block the fleet
        ever stored would stay."""
        if self.block_retention is None:
            return 0
        retention = self.block_retention.total_seconds()
        now = time.monotonic()
        if not force and now < self._next_expiry:
            return 0
        self._next_expiry = now + min(60.0, max(1.0, retention / 10))
        started, dropped = time.perf_counter(), 0
        slices = self.store.expire_slices(_clock() - int(retention), EXPIRY_SLICE)
        while True:  # the lock held a slice at a time: lookups go on in between
            with self.lock, collector_paused():
                step = next(slices, None)
            if step is None:
                break
            dropped += step
        self.blocks_expired += dropped
        metrics.ROUTER_BLOCKS_EXPIRED.inc(dropped)
        if dropped:
            logger.info(
                "router forgot %d blocks unheld for %s (%.3f s)",
                dropped, show_duration(self.block_retention), time.perf_counter() - started,
            )  # fmt: skip
        return dropped

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
        return Position(applied, dict(self._ends), behind, seconds, self._bootstrap_s, self.error)

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

    # ------------------------------------------------------------------ lookups
    def match(
        self,
        model: str,
        group_idx: int,
        hashes: Sequence[bytes],
        granularity: Granularity = "block",
        include_silent: bool = False,
        silent_after: timedelta | None = None,
    ) -> list[Holder]:
        """As :meth:`PrefixIndex.match`, from memory."""
        with self.lock:
            found = m.held_prefix(self.store, model, group_idx, hashes, granularity)
            return m.answer(self.store, found, include_silent, silent_after, _now())

    def match_tokens(
        self,
        model: str,
        group_idx: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        include_silent: bool = False,
        silent_after: timedelta | None = None,
        cache_salt: str | None = None,
    ) -> list[Holder]:
        """As :meth:`PrefixIndex.match_tokens`, from memory."""
        with self.lock:
            found = m.held_tokens(self.store, model, group_idx, token_ids, lora_name, cache_salt)
            return m.answer(self.store, found, include_silent, silent_after, _now())

    def held_path(
        self, model: str, group_idx: int, token_ids: Sequence[int], lora_name: str | None,
        cache_salt: str | None, holder: tuple[str, str, str],
    ) -> list[bytes]:  # fmt: skip
        """The block hashes of the prompt's leading blocks that ``holder`` (instance, medium,
        ownership) holds, found by their tokens (what a decision by token ids captured)."""
        with self.lock:
            return m.held_path(self.store, model, group_idx, token_ids, lora_name, cache_salt,
                               holder)  # fmt: skip

    def state_checkpoints(
        self, model: str, group_idx: int, hashes: Sequence[bytes], upto: Mapping[str, int]
    ) -> dict[str, int]:
        """As :meth:`PrefixIndex.state_checkpoints`, from memory."""
        top = min(max(upto.values(), default=0), len(hashes))
        found: list[tuple[str, int]] = []
        with self.lock:
            g = self.store.groups.get(GroupKey(model, group_idx))
            if g is None:
                return {}
            holders = self.store.holders
            for pos in range(top, 0, -1):
                found += [(holders[hid][0], pos) for hid, _, _ in g.runs([hashes[pos - 1]])]
        return deepest_states(found, upto)

    def block_size(self, model: str, group_idx: int) -> int | None:
        """The group's block size in tokens (None: no such group in the index)."""
        with self.lock:
            held = self.store.specs.get(GroupKey(model, group_idx))
        return held.spec.block_size if held is not None and held.spec.block_size > 0 else None

    def states(self, instances: Sequence[str], silent_after: timedelta | None) -> dict[str, str]:
        """Each instance's state (live, silent, closed, unknown) in the liveness window."""
        window = silent_after if silent_after is not None else m.DEFAULT_SILENT_AFTER
        now = _now()
        with self.lock:
            return {i: m.state_of(self.store.lives.get(i), now, window) for i in instances}

    def loads(self, model: str, silent_after: timedelta | None = None) -> list[EngineLoad]:
        """As :meth:`PrefixIndex.loads`, from memory."""
        now = _now()
        with self.lock:
            return m.loads(self.store.lives, model, now, silent_after)

    def footprint(self) -> dict[tuple[str, str], dict[str, int]]:
        """Blocks held per (instance, model) and tier (the dashboard's fleet in memory). The
        count walks every holder's blocks, so the lock is taken per group and holder (a
        lookup waits for one holder's list at most); the dashboard shares each answer
        between its viewers (serving/lookup/dashboard.py's SharedAnswers)."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        with self.lock:
            groups, holders = list(self.store.groups.items()), list(self.store.holders)
        for key, g in groups:
            for hid, (instance, medium, _) in enumerate(holders):
                with self.lock:
                    n = len(g.held_by(hid))
                if n:
                    tiers = out.setdefault((instance, key[0]), {})
                    tiers[medium] = tiers.get(medium, 0) + n
        return out

    def knows_group(self, model: str, group_idx: int) -> bool:
        """As :meth:`PrefixIndex.knows_group`, from memory."""
        with self.lock:
            return GroupKey(model, group_idx) in self.store.specs


def _now() -> datetime:
    return datetime.now(UTC)


def _clock() -> int:
    """The blocks' clock: whole seconds of the wall clock."""
    return int(time.time())
