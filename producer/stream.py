"""One source's messages on its topic: what goes on the wire, in which order, under which key.

A :class:`SourceStream` numbers each group's messages (contiguous sequence numbers per
epoch), keys them ``<source>/<group>`` (one partition each, so in order), writes their
envelopes (encoded by the codec, or framed around prepared event bytes: :func:`.prepared.frame`)
and hands them to the Kafka client (:class:`~.delivery.Deliveries`: waiting while its queue
is full, refusing what the topic cannot take). It holds no lock: its publisher serializes
every call (:mod:`.publisher`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Producer

from kvledger.producer.config import PublisherConfig
from kvledger.producer.delivery import Deliveries
from kvledger.producer.prepared import Prepared, WireForm, frame
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import (
    DEFAULT_GROUP_IDX,
    AllBlocksCleared,
    Envelope,
    Goodbye,
    GroupSpec,
    Heartbeat,
    KVEvent,
    group_of,
)
from kvledger.schemas.topics import message_key

logger = logging.getLogger(__name__)

# An envelope's event time, engine batch and data-parallel rank when the caller knows them.
Stamp = tuple[int | None, int | None, int | None]
NO_STAMP: Stamp = (None, None, None)
# How often a write serves the client's reports (failures only: none while all is well).
POLL_INTERVAL_S = 0.005


class SourceStream:
    """The messages of one source (see the module docstring). ``healthy`` raises when the
    publisher cannot go on (closed, a fatal error, failed deliveries); ``clock`` gives the
    event time of messages the caller did not stamp."""

    def __init__(  # noqa: PLR0913 - the publisher's parts it writes through (one caller)
        self,
        config: PublisherConfig,
        codec: Codec,
        form: WireForm,
        deliveries: Deliveries,
        producer: Producer,
        healthy: Callable[[], None],
        clock: Callable[[], float],
        epoch: int,
    ) -> None:
        self.config = config
        self.codec = codec
        self.form = form
        self.deliveries = deliveries
        self.producer = producer
        self._heads: dict[int | None, bytes] = {}  # this epoch's, by rank as given (or None)
        self.epoch = epoch
        self.seqs: dict[int, int] = {}  # each group's next sequence number in this epoch
        self.last_produce = self._last_poll = time.monotonic()
        self._healthy = healthy
        self._clock = clock
        self._keys: dict[int, bytes] = {}
        self._warned_unannounced: set[int] = set()

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        """A new epoch: envelope heads are made again (each carries its epoch)."""
        self._epoch = epoch
        self._heads.clear()

    @property
    def groups(self) -> list[int]:
        """The groups this source has announced or published in."""
        return sorted(set(self.seqs) | set(self.form.specs))

    def home_group(self) -> int:
        """The stream that carries the source's own messages (heartbeats, goodbye)."""
        groups = set(self.seqs) | set(self.form.specs)
        return min(groups) if groups else DEFAULT_GROUP_IDX

    # ------------------------------------------------------------------ writing
    def write_vllm(self, events: Iterable[Any], stamp: Stamp = NO_STAMP) -> int:
        """One batch of vLLM's event objects, prepared whole before any is produced (raises
        :class:`~.vllm.VllmEventError` for one that cannot be read); returns how many."""
        return self.write(self.form.prepare(events), stamp)

    def write(
        self, items: list[Prepared | KVEvent], stamp: Stamp = NO_STAMP, start: int = 0
    ) -> int:
        """Produce, in order, prepared vLLM events and kvledger's own (from ``start``);
        returns how many items there are."""
        time_ms, engine_seq, dp_rank = stamp
        head, now_ms = b"", 0
        for item in items[start:] if start else items:
            if type(item) is not tuple:  # kvledger's types
                self.event(item, stamp)  # type: ignore[arg-type]
                continue
            if not head:
                head = self._head(dp_rank)
                now_ms = time_ms if time_ms is not None else int(self._clock() * 1000)
            kind, group, body = item
            self._check_announced(group)
            seq = self._number(group)
            self._send(group, seq, kind, frame(head, seq, now_ms, body, engine_seq))
        self._produced(len(items))
        return len(items)

    def event(self, event: KVEvent, stamp: Stamp = NO_STAMP) -> None:
        """One of kvledger's events: a group's spec (announced if new), an AllBlocksCleared
        (written to every group the source uses), any other as it is."""
        if isinstance(event, GroupSpec):
            if event.group_idx not in self.form.specs:
                self.form.announce(event)
            self.encode(event.group_idx, event, stamp)
        elif isinstance(event, AllBlocksCleared):
            self.clear_all(event.medium, stamp)
        else:
            self.encode(group_of(event), self.form.hashes(event), stamp)

    def clear_all(self, medium: str | None, stamp: Stamp = NO_STAMP) -> int:
        """AllBlocksCleared once for every group this source has used."""
        groups = self.groups
        for group in groups:
            self.encode(group, AllBlocksCleared(group_idx=group, medium=medium), stamp)
        return len(groups)

    def encode(self, group: int, event: KVEvent, stamp: Stamp = NO_STAMP) -> None:
        """The next message of ``group``, its envelope encoded whole by the codec."""
        if not isinstance(event, GroupSpec | Heartbeat | Goodbye):  # not the source's own
            self._check_announced(group)
        seq = self._number(group)
        time_ms, engine_seq, dp_rank = stamp
        envelope = Envelope(
            source=self.config.source_id,
            model=self.config.model,
            dp_rank=dp_rank if dp_rank is not None else self.config.dp_rank,
            epoch=self.epoch,
            seq=seq,
            event_time_ms=time_ms if time_ms is not None else int(self._clock() * 1000),
            event=event,
            engine_seq=engine_seq,
        )
        self._send(group, seq, type(event).__name__, self.codec.encode(envelope))

    def poll(self, now: float) -> None:
        """Serve the client's reports (failed deliveries, errors)."""
        self._last_poll = now
        self.producer.poll(0)

    # ------------------------------------------------------------------ internals
    def _produced(self, n: int) -> None:
        """After a write of ``n`` items: the time of the last produce, and the client's
        reports served if they have waited long enough (failures only come)."""
        now = time.monotonic()
        if n:
            self.last_produce = now
        if now - self._last_poll >= POLL_INTERVAL_S:
            self.poll(now)

    def _head(self, dp_rank: int | None) -> bytes:
        """The envelope head of this epoch's messages for a rank (default: the configured),
        kept under the rank as given."""
        head = self._heads.get(dp_rank)
        if head is None:
            rank = dp_rank if dp_rank is not None else self.config.dp_rank
            head = self._heads[dp_rank] = self.codec.envelope_head(
                self.config.source_id, self.config.model, rank, self._epoch
            )
        return head

    def _number(self, group: int) -> int:
        """The next sequence number of ``group``, taken (``_send`` gives back a refused one's)."""
        seq = self.seqs.get(group, 0)
        self.seqs[group] = seq + 1
        return seq

    def _check_announced(self, group: int) -> None:
        if group not in self.form.specs and group not in self._warned_unannounced:
            self._warned_unannounced.add(group)
            logger.warning(
                "source %s publishes group %d without announcing it: consumers reject its "
                "events unless an operator declares the group",
                self.config.source_id,
                group,
            )

    def _send(self, group: int, seq: int, kind: str, value: bytes) -> None:
        """Produce message ``seq`` of ``group``; a message too large for the topic is not
        produced, and its number goes to the next one."""
        key = self._keys.get(group)
        if key is None:
            key = self._keys[group] = message_key(self.config.source_id, group)
        if self.deliveries.send(self.producer, key, value, kind, self._healthy):
            self.last_produce = time.monotonic()
        else:
            self.seqs[group] = seq
