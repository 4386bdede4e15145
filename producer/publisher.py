"""Tracker events to Kafka: envelope, Avro, key ``<source>/<group>``, no silent loss.

An engine integration needs three calls::

    publisher = KVEventPublisher(config)                    # owns a tracker and a producer
    publisher.announce_groups(group_configs)                # once, at start-up
    publisher.tracker.record_store(...)                     # as the scheduler works
    publisher.publish(manager.take_events())                # every scheduler step
    publisher.close(timeout=30)                             # on shutdown: goodbye, flush

Liveness: while the engine publishes nothing for ``heartbeat_interval_s``, a background
thread sends a Heartbeat, so the index can tell an idle engine from a dead one; ``close``
says Goodbye (a planned shutdown, not a silence) unless told not to.

Ordering: every message of one (source, group) has the same key, hence one partition, and is
produced in publish order by an idempotent producer, so consumers see it in order with
contiguous sequence numbers. Each publisher instance is a new epoch (ms at start-up).

Thread-safety: ``publish``/``announce_groups``/``clear_all`` take one lock, so calls from
several threads are serialized; the tracker itself belongs to the scheduler thread that calls
``record_*``. ``stats`` may be read from any thread.

The engine's thread waits on as little as it can: ``publish_vllm_batch`` and ``publish``
hand their batch to a background thread that maps, encodes and produces it
(:mod:`.handoff`; ``PublisherConfig.handoff_batches``), as vLLM's own publisher does. A
full queue blocks; a batch that cannot be written raises from the next call, ``flush`` or
``close``; every other write (announcements, clears, the goodbye, ``publish_events``) waits
for the batches before it, so the stream keeps the order of the calls.

Transactions (``PublisherConfig.transactional_id``, the relay's mode): the caller brackets
its publishes with ``begin``/``commit`` (or ``abort``); readers that read committed messages
(librdkafka's default) see each transaction whole or not at all. No heartbeat thread then:
the caller sends its own. Those methods and the epoch's are in :mod:`.stream_control`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from confluent_kafka import Producer

from kvledger.producer.config import PublisherConfig
from kvledger.producer.delivery import Deliveries, PublisherStats
from kvledger.producer.errors import PublishError, QueueFullError
from kvledger.producer.handoff import Handoff
from kvledger.producer.prepared import Prepared, WireForm
from kvledger.producer.stream import NO_STAMP, SourceStream, Stamp
from kvledger.producer.stream_control import StreamControl
from kvledger.producer.tracker import (
    GroupConfigLike,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    group_announcement,
)
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import (
    EventsLost,
    Goodbye,
    GroupSpec,
    Heartbeat,
    KVEvent,
    group_of,
)
from kvledger.schemas.kafka_log import client_logging

logger = logging.getLogger(__name__)

_N = TypeVar("_N", int, int | None)  # what a stream's write returns


class KVEventPublisher(StreamControl):
    """Publishes a source's KV cache events to Kafka (see the module docstring); its
    transactions and epochs, the relay's, are :class:`~.stream_control.StreamControl`'s."""

    def __init__(
        self,
        config: PublisherConfig,
        tracker: OffloadingEventsTracker | None = None,
        codec: Codec | None = None,
        clock: Callable[[], float] = time.time,
        epoch: int | None = None,
    ) -> None:
        self.config = config
        self.tracker = (
            tracker
            if tracker is not None
            else OffloadingEventsTracker(vllm_version=config.vllm_version)
        )
        self.codec = codec if codec is not None else Codec()
        self._deliveries = Deliveries(config.topic)
        self._lock = threading.Lock()
        self._closed = False
        settings = config.sized_settings()
        limit = int(str(settings.get("message.max.bytes", 1_000_000)))
        self._form = WireForm(
            config.hash_format == "digest",
            codec=self.codec,
            max_bytes=limit - envelope_reserve(config),
        )
        settings["error_cb"] = self._deliveries.on_error
        # Reports of failures only: a message leaves librdkafka's queue delivered or failed,
        # so the acknowledged are counted without a callback each (``stats``).
        settings["on_delivery"] = self._deliveries.on_delivery
        settings["delivery.report.only.error"] = True
        self._producer = Producer(client_logging(settings))
        self._stream = SourceStream(
            config,
            self.codec,
            self._form,
            self._deliveries,
            self._producer,
            healthy=self._check_healthy,
            clock=clock,
            epoch=epoch if epoch is not None else int(clock() * 1000),
        )
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._transactional = config.transactional_id is not None
        self._handoff: Handoff | None = None
        if config.handoff_batches > 0 and not self._transactional:
            self._handoff = Handoff(
                self._write_handed, config.handoff_batches, f"kvledger-publish-{config.source_id}"
            )
        if config.heartbeat_interval_s > 0 and not self._transactional:
            self._heartbeat = threading.Thread(
                target=self._beat, name=f"kvledger-heartbeat-{config.source_id}", daemon=True
            )
            self._heartbeat.start()

    # ------------------------------------------------------------------ public API
    def announce_groups(self, group_configs: Iterable[GroupConfigLike]) -> None:
        """Announce each group's shape the first time it is seen, before any of its events."""
        self._drain()
        with self._lock:
            for cfg in group_configs:
                if cfg.group_idx in self._form.specs:
                    continue
                self.tracker.set_group_spec(cfg.group_idx, cfg.kv_event_group_spec)
                announcement = self._with_policy(group_announcement(self.config.model, cfg))
                self._form.announce(announcement)
                self._stream.encode(cfg.group_idx, announcement)

    def announce_group_spec(self, spec: GroupSpec) -> None:
        """Announce a group from an explicit spec (for engines without group configs)."""
        self._drain()
        with self._lock:
            if spec.group_idx not in self._form.specs:
                spec = self._with_policy(spec)
                self._form.announce(spec)
                self.tracker.set_group_spec(
                    spec.group_idx, OffloadingEventGroupSpec(spec.kind, spec.sliding_window)
                )
                self._stream.encode(spec.group_idx, spec)

    def publish(self, offloading_events: Iterable[OffloadingEvent]) -> int:
        """Translate one batch of the manager's events (on the caller's thread: the tracker
        is its own) and produce them, or hand them to the writer thread; returns messages."""
        handoff = self._handoff
        if handoff is not None:
            self._check_open()
            events = self.tracker.take_events(offloading_events)
            handoff.put((self._stream_events, events, NO_STAMP))
            return len(events)
        with self._lock:
            self._check_healthy()
            events = self.tracker.take_events(offloading_events)
            return self._write(self._stream_events, events, NO_STAMP)

    def publish_events(
        self,
        events: Iterable[KVEvent],
        *,
        time_ms: int | None = None,
        engine_seq: int | None = None,
        dp_rank: int | None = None,
    ) -> int:
        """Produce events that are already self-describing (kvledger's types); the keywords
        as :meth:`publish_prepared` takes them."""
        return self.publish_prepared(
            events, time_ms=time_ms, engine_seq=engine_seq, dp_rank=dp_rank
        )

    def publish_vllm_batch(
        self, batch: Any, engine_seq: int | None = None, wait_s: float | None = None
    ) -> int:
        """vLLM's entry point: a KVEventBatch (``events``; ``ts`` and ``data_parallel_rank``
        when it has them), published with the batch's time and rank.

        Events carry vLLM's field names (:mod:`.vllm`); partial recurrent tails are marked
        from the group's announced spec. The batch is handed to the writer thread (the
        module docstring); returns how many events it has. A batch with an event that cannot
        be read publishes nothing, and :class:`~.vllm.VllmEventError` raises from the next
        call, ``flush`` or ``close`` (from this one with ``handoff_batches=0``).
        ``engine_seq``: the batch's number in the engine's stream (the relay's position).
        ``wait_s``: a full queue waits this long at most, then :class:`QueueFullError`
        raises and the batch is not taken (the caller records it lost: :meth:`record_lost`).
        """
        try:  # vLLM's batches have both (attributes read directly: ~70 ns less than getattr)
            ts, rank = batch.ts, batch.data_parallel_rank
        except AttributeError:
            ts, rank = getattr(batch, "ts", None), getattr(batch, "data_parallel_rank", None)
        time_ms = int(ts * 1000) if ts is not None else None
        handoff = self._handoff
        if handoff is not None:  # the engine's thread pays a queue put; the writer the rest
            self._check_open()
            events = list(batch.events)
            item = (self._stream.write_vllm, events, (time_ms, engine_seq, rank))
            if not handoff.put(item, wait_s):
                raise QueueFullError(f"{len(events)} events not taken: the queue stayed full")
            return len(events)
        with self._lock:
            return self._write(self._stream.write_vllm, batch.events, (time_ms, engine_seq, rank))

    def record_lost(self, first_seq: int, last_seq: int, wait_s: float | None = None) -> bool:
        """Say that engine batches ``first_seq..last_seq`` were not published (the index then
        ends what the source held in each group: it can no longer know it), after every
        batch handed over before; False when the queue stayed full for ``wait_s`` (nothing
        said: ask again)."""
        lost = [EventsLost(first_seq, last_seq, g) for g in self.groups] or [
            EventsLost(first_seq, last_seq)
        ]
        if self._handoff is None:
            with self._lock:
                self._write(self._stream_events, lost, NO_STAMP)
            return True
        self._check_open()
        return self._handoff.put((self._stream_events, lost, NO_STAMP), wait_s)

    def prepare_vllm(self, events: Iterable[Any]) -> list[Prepared | KVEvent]:
        """vLLM events (objects with vLLM's names, or already mapped by :mod:`.vllm`) in
        this source's wire form, for :meth:`publish_prepared`; raises
        :class:`~.vllm.VllmEventError` for one that cannot be read."""
        with self._lock:
            return self._form.prepare(events)

    def publish_prepared(
        self,
        items: Iterable[Prepared | KVEvent],
        *,
        time_ms: int | None = None,
        engine_seq: int | None = None,
        dp_rank: int | None = None,
    ) -> int:
        """Produce events that are self-describing: kvledger's types, or vLLM events
        prepared by :meth:`prepare_vllm`.

        ``time_ms``: their event time (default: now); ``engine_seq``: the engine batch they
        came in (relayed engines); ``dp_rank``: the engine's data-parallel rank when it says
        (default: the configured one).
        """
        items = items if type(items) is list else list(items)
        self._drain()
        with self._lock:
            return self._write(self._stream.write, items, (time_ms, engine_seq, dp_rank))

    @property
    def stats(self) -> PublisherStats:
        """The publisher's counters. ``acked``: produced, less failed, less still queued
        (librdkafka reports failures only; exact once flushed)."""
        return self._deliveries.counted(queued=len(self._producer))

    @property
    def groups(self) -> list[int]:
        """The groups this source has announced or published in."""
        return self._stream.groups

    def announced(self, group: int) -> GroupSpec | None:
        return self._form.specs.get(group)

    def clear_all(self, medium: str = "GPU") -> int:
        """Write AllBlocksCleared once for every group this source has used."""
        self._drain()
        with self._lock:
            self._check_healthy()
            return self._stream.clear_all(medium)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for every handed-over batch to be written and every produced message to be
        acknowledged; raise if any is not."""
        if self._handoff is not None:
            self._handoff.drain(timeout)
        remaining = self._producer.flush(timeout)
        self._deliveries.raise_failures()
        if remaining:
            raise PublishError(
                f"{remaining} message(s) still unacknowledged after {timeout:.1f} s "
                f"(bootstrap {self.config.bootstrap_servers})"
            )

    def close(self, timeout: float = 30.0, goodbye: bool = True) -> None:
        """Say goodbye (unless told not to), flush within ``timeout`` and stop; raises if
        anything is still unacked or failed.

        ``goodbye=False`` for a process that stops publishing for engines that go on (the
        index keeps their blocks and treats them as silent once they stay quiet).
        """
        if self._closed:
            return
        failure: Exception | None = None
        if self._handoff is not None:  # every batch handed over is written first
            try:
                self._handoff.stop(timeout)
            except Exception as exc:  # raised once the rest is flushed
                failure = exc
        self._stopping.set()
        with self._lock:
            if goodbye and self._deliveries.fatal is None and self._stream.groups:
                home = self._stream.home_group()
                self._stream.encode(home, Goodbye(group_idx=home))
            self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self.flush(timeout)
        if failure is not None:
            raise failure

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the original exception behind a flush failure
            try:
                self.close()
            except PublishError as close_error:
                logger.error("while closing after an error: %s", close_error)

    # ------------------------------------------------------------------ internals
    def _write_handed(self, item: tuple[Callable[[Any, Stamp], int], Any, Stamp]) -> None:
        """The writer thread's work: one handed-over batch, as the caller would have written
        it."""
        write, events, stamp = item
        with self._lock:
            self._write(write, events, stamp)

    def _stream_events(self, events: list[KVEvent], stamp: Stamp) -> int:
        """The tracker's events of one batch, each encoded whole."""
        for event in events:
            self._stream.encode(group_of(event), self._form.hashes(event))
        self._stream.poll(time.monotonic())
        return len(events)

    def _drain(self) -> None:
        """Before a write that must follow the batches handed over: wait for them."""
        if self._handoff is not None:
            self._handoff.drain()

    def _unhealthy(self) -> bool:
        """Whether ``_check_healthy`` would raise (read without the lock: a cheap test)."""
        deliveries = self._deliveries
        return self._closed or deliveries.fatal is not None or bool(deliveries.stats.failed)

    def _check_open(self) -> None:
        """Refuse a batch the publisher cannot take (closed, fatal, failed deliveries)."""
        if self._unhealthy():
            with self._lock:
                self._check_healthy()

    def _write(self, write: Callable[[Any, Stamp], _N], items: Any, stamp: Stamp) -> _N:
        """One of the stream's writes (the lock held): refused if the publisher cannot go
        on, and raising for what the topic refused (the others produced)."""
        deliveries = self._deliveries
        if self._unhealthy():
            self._check_healthy()
        if deliveries.refused:
            deliveries.refused = []
        n = write(items, stamp)
        if deliveries.refused:
            deliveries.raise_refused()
        return n

    def _with_policy(self, spec: GroupSpec) -> GroupSpec:
        """The spec with this engine's policies: its surviving media (unless the spec names
        its own) and whether it reports reused blocks."""
        media = spec.surviving_media
        if media is None:
            media = self.config.surviving_media
        reports = spec.reports_reuse or self.config.reports_reuse
        if media == spec.surviving_media and reports == spec.reports_reuse:
            return spec
        return dataclasses.replace(spec, surviving_media=media, reports_reuse=reports)

    def _beat(self) -> None:
        interval = self.config.heartbeat_interval_s
        beat = Heartbeat(interval_ms=int(interval * 1000))
        while not self._stopping.wait(min(interval, 1.0)):
            with self._lock:
                if self._closed or self._deliveries.fatal is not None:
                    return
                now = time.monotonic()
                if now - self._stream.last_produce < interval:
                    continue
                group = self._stream.home_group()
                try:
                    self._stream.encode(group, dataclasses.replace(beat, group_idx=group))
                    self._stream.poll(now)
                except PublishError as exc:  # reported by the next publish or close
                    logger.warning("heartbeat not sent: %s", exc)

    def _check_healthy(self) -> None:
        if self._closed:
            raise PublishError("the publisher is closed")
        self._deliveries.raise_fatal()
        self._deliveries.raise_failures()


def envelope_reserve(config: PublisherConfig) -> int:
    """What a message takes beside its event: the envelope's header, names and numbers, the
    key, and Kafka's record framing (with room to spare)."""
    names = len(config.source_id.encode()) + len(config.model.encode())
    return 1024 + 2 * names
