"""RouterIndex: prefix lookups from memory, with the durable index's answers.

1. :meth:`RouterIndex.bootstrap` reads one consistent snapshot of the PostgreSQL index —
   group specs, the blocks lookups need, live residencies, source states and lives, and the
   consumer group's stored offsets — in one REPEATABLE READ transaction (:mod:`.snapshot`).
2. :meth:`RouterIndex.start` tails the topic from exactly those offsets (:mod:`.tail`: its
   own assignment of every partition, no consumer-group commits, on the one log loop);
   :meth:`RouterIndex.apply` takes each batch through the same pipeline and pure core as
   the consumer (its commonest events in one native call each: :mod:`.lane`) into the
   :class:`RouterStore`: no gap, no double count, the same rejections; :meth:`expire`
   forgets the blocks past their retention.
3. :meth:`match`, :meth:`match_tokens` and the other lookups (:mod:`.lookups`; and
   :func:`~kvledger.serving.lookup.rank`) answer as the SQL functions do at the same log
   position; :meth:`position` says which.

This module holds the index's state, its bootstrap, apply and expiry; :class:`RouterIndex`
is all three parts. Any number of routers can run: each is an independent reader of the log.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol

import psycopg

from kvledger.consumer import metrics
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.retention_policy import Retention, show_duration
from kvledger.schemas.codec import Codec
from kvledger.schemas.registry import RegistryUnavailableError
from kvledger.serving.router.lane import LaneObserver, Tally, run_router_batch
from kvledger.serving.router.lookups import Lookups
from kvledger.serving.router.snapshot import load_snapshot
from kvledger.serving.router.store import RouterStore
from kvledger.serving.router.tail import Position, Tail

__all__ = ["APPLY_CHUNK", "ApplyObserver", "Position", "RouterIndex", "collector_paused"]

logger = logging.getLogger(__name__)


# Messages applied per hold of the lock lookups take (see RouterIndex.apply).
APPLY_CHUNK = 500
# How long a chunk waits for a schema registry that does not answer before it asks again
# (doubling up to the most).
REGISTRY_WAIT_S, REGISTRY_WAIT_MAX_S = 0.5, 10.0
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


class ApplyObserver(LaneObserver, Protocol):
    """A :class:`LaneObserver` also told when each chunk has applied (under the lookups'
    lock, so it reads the store as the chunk left it)."""

    def applied(self) -> None: ...


class RouterIndex(Tail, Lookups):
    """The in-memory router index (see the module docstring): its tail (:class:`.tail.Tail`)
    and its lookups (:class:`.lookups.Lookups`) are parts of it."""

    def __init__(  # noqa: PLR0913 - serve --memory's options, keyword with defaults
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
        self.lock = threading.RLock()  # a lookup's, or a chunk applied
        self._bootstrap_s = 0.0
        self.applied_messages = 0
        self.block_events = 0
        self.error: str | None = None  # why the tail stopped, if it did
        self.waiting_for: str | None = None  # what the tail waits for, while it does
        # A block no one holds or names as its parent is forgotten this long after it was
        # last stored or held (None: never), checked every tenth of it (1 s to 60 s).
        self.block_retention = block_retention
        self._next_expiry = 0.0
        self.blocks_expired = 0
        self.observer: ApplyObserver | None = None  # told what each chunk applied
        super().__init__()

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

    # ------------------------------------------------------------------ apply
    def apply(self, batch: Sequence[Inbound]) -> None:
        """Apply consumed messages, in log order, through the pipeline into the store.

        In chunks of :data:`APPLY_CHUNK` under the lookups' lock, so a lookup waits for one
        chunk at most (~10 ms), never for a whole poll's worth of messages."""
        for i in range(0, len(batch), APPLY_CHUNK):
            tally = self._apply_chunk(batch[i : i + APPLY_CHUNK])
            self.applied_messages += tally.messages
            self.block_events += tally.block_events
        self.expire()

    def _apply_chunk(self, chunk: Sequence[Inbound]) -> Tally:
        """One chunk applied; while the schema registry its writers' schemas come from does
        not answer, the chunk waits for it (its messages are decoded before the store is
        touched: nothing of it is applied meanwhile), until the router is stopped. The
        schemas are asked of the registry before the lookups' lock is taken, so that lookups
        never wait on the registry."""
        wait = REGISTRY_WAIT_S
        while True:
            try:
                self.codec.resolve_writers(m.value for m in chunk)
                with self.lock, collector_paused():
                    # The router is its store's only writer: its reading began where the
                    # store's offsets stand (past any transaction marker between batches).
                    stored = self.store.stored_offsets(self.consumer_group, self.topic)
                    self.store.set_clock(_clock())
                    tally = run_router_batch(
                        chunk,
                        self.codec,
                        self.store,
                        self.consumer_group,
                        read_from={(self.topic, p): o for p, o in stored.items()},
                        observer=self.observer,
                    )
                    if self.observer is not None:
                        self.observer.applied()
                self.waiting_for = None
                return tally
            except RegistryUnavailableError as exc:
                if self.waiting_for is None:
                    logger.warning("router waiting for the schema registry: %s", exc)
                self.waiting_for = f"the schema registry: {exc}"
                if self._stop.wait(wait):
                    raise
                wait = min(wait * 2, REGISTRY_WAIT_MAX_S)

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
                if step is not None:  # counted with its slice: the store and count agree
                    self.blocks_expired += step
            if step is None:
                break
            dropped += step
        metrics.ROUTER_BLOCKS_EXPIRED.inc(dropped)
        if dropped:
            logger.info(
                "router forgot %d blocks unheld for %s (%.3f s)",
                dropped,
                show_duration(self.block_retention),
                time.perf_counter() - started,
            )
        return dropped


def _clock() -> int:
    """The blocks' clock: whole seconds of the wall clock."""
    return int(time.time())
