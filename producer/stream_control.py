"""What the relay asks of a publisher beside publishing: its stream under the caller's
control. Kafka transactions (``PublisherConfig.transactional_id``: readers that read
committed messages see each transaction whole or not at all), and the stream's epoch and
sequence numbers (resumed after a relay's restart, a new epoch after an engine's).
:class:`~.publisher.KVEventPublisher` has these methods; the relay's loop
(:mod:`.relay.relay`) and its transactions (:mod:`.relay.transaction`) call them.
"""

from __future__ import annotations

import threading

from confluent_kafka import Producer

from kvledger.producer.delivery import Deliveries
from kvledger.producer.prepared import WireForm
from kvledger.producer.stream import SourceStream


class StreamControl:
    """A publisher's transactions and epochs (the module docstring); the publisher sets
    the state they share with it."""

    _producer: Producer
    _deliveries: Deliveries
    _lock: threading.Lock
    _stream: SourceStream
    _form: WireForm

    # ------------------------------------------------------------------ transactions
    def init_transactions(self, timeout: float = 30.0) -> None:
        """Register the transactional id with the broker, fencing any earlier producer of
        that id and aborting its open transaction."""
        self._producer.init_transactions(timeout)

    def begin(self) -> None:
        self._producer.begin_transaction()

    def commit(self, timeout: float = 30.0) -> None:
        """Commit the open transaction: every message of it is acknowledged, or this raises
        (``KafkaException``; ``txn_requires_abort()`` says whether to abort)."""
        self._producer.commit_transaction(timeout)
        self._deliveries.raise_failures()

    def abort(self, timeout: float = 30.0) -> None:
        self._producer.abort_transaction(timeout)
        with self._lock:  # the aborted messages' failures belong to the aborted transaction
            self._deliveries.forget_failures()

    # ------------------------------------------------------------------ epochs
    @property
    def epoch(self) -> int:
        """This stream's epoch (ms at the publisher's start, unless set)."""
        return self._stream.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        with self._lock:
            self._stream.epoch = epoch

    def resume(self, epoch: int, next_seqs: dict[int, int]) -> None:
        """Continue a stream another process wrote (a relay after its restart): its epoch
        and each group's next sequence number."""
        with self._lock:
            self._stream.epoch = epoch
            self._stream.seqs = dict(next_seqs)

    def new_epoch(self, epoch: int) -> None:
        """Start a new epoch (an engine restart seen by its relay): sequences from 0, each
        announced group announced again as the new epoch's first message."""
        with self._lock:
            self._stream.epoch = epoch
            self._stream.seqs = {}
            for group, spec in sorted(self._form.specs.items()):
                self._stream.encode(group, spec)

    def next_seqs(self) -> dict[int, int]:
        """Each group's next sequence number in this epoch."""
        with self._lock:
            return dict(self._stream.seqs)
