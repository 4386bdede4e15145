"""A relay rank's state, and what it publishes into the open transaction: an engine batch
(prepared whole first), a range of batches lost, a heartbeat. :class:`~.relay.RankRelay`
adds the loop that decides when (the module docstring of :mod:`.relay` says how).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvledger.producer.errors import MessageTooLargeError, PublishError
from kvledger.producer.publisher import KVEventPublisher
from kvledger.producer.relay import sglang, trtllm
from kvledger.producer.relay.config import RelayConfig
from kvledger.producer.relay.engine import EngineLink
from kvledger.producer.relay.health import HealthWatch
from kvledger.producer.relay.load import LoadReader
from kvledger.producer.relay.metrics import RelayMetrics, StreamTally
from kvledger.producer.relay.sequence import EngineSequence
from kvledger.producer.relay.transaction import RelayTransactions
from kvledger.producer.relay.wire import EngineBatch, read_batch
from kvledger.producer.vllm import VllmEventError
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import EventsLost, Heartbeat

logger = logging.getLogger("kvledger.producer.relay.relay")  # the relay's one logger

# The widest range of lost batches counted as such: 2**32 batches is over a year of an
# engine's steps at 100 a second; a wider jump is an engine's numbering, not its steps.
MAX_GAP = 1 << 32


class RankState:
    """One data-parallel rank's state: its source, engine link, sequence, transactions,
    metrics and load reader; and the acts that publish into its open transaction."""

    def __init__(
        self,
        config: RelayConfig,
        rank: int = 0,
        metrics: RelayMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._read = {
            "sglang": sglang.read_batch,
            "trtllm": trtllm.TrtllmReader(config.groups).read_batch,
        }.get(config.engine, read_batch)
        self.rank = rank
        self.source = config.rank_source(rank)
        self.metrics = metrics or RelayMetrics()
        self.metrics.start(self.source)
        self._tally = StreamTally(self.metrics, self.source)
        self._clock = clock
        self._stop = threading.Event()
        self.sequence = EngineSequence()
        self.codec = config.codec or Codec()
        self.link: EngineLink | trtllm.TrtllmLink | None = None
        self.txn = RelayTransactions(config, rank, self.codec, self.metrics, self._stop)
        self._last_activity = time.monotonic()
        self._last_heartbeat = 0.0
        self.load: LoadReader | None = None
        if config.engine_metrics_url is not None:
            self.load = LoadReader(
                config.engine_metrics_url,
                config.heartbeat_interval_s,
                rank if config.dp_size > 1 else None,
                config.health_timeout_s,
                on_error=self.metrics.load_errors.labels(self.source).inc,
            )
        self.health: HealthWatch | None = None
        if config.health_url is not None:
            self.health = HealthWatch(
                config.health_url,
                config.heartbeat_interval_s,
                config.health_timeout_s,
                on_unhealthy=self.metrics.unhealthy.labels(self.source).inc,
            )
        self.ready = threading.Event()  # set once resynchronised with the engine

    @property
    def committed_seq(self) -> int | None:
        """The last engine batch whose transaction is committed (readers can see it)."""
        return self.txn.committed_seq

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ publishing
    def _publish(self, seq: int, batch: EngineBatch | None, time_ms: int | None) -> None:
        self.txn.begin()  # the group specs lead a relay's first transaction: fit to them
        pub, count = self._pub, None
        if batch is not None:
            try:  # read whole before any of it is produced
                prepared = pub.prepare_vllm(batch.events)
            except Exception as exc:  # any reason: the batch's loss, not the relay's stop
                self._undecodable(seq, exc)
            else:
                try:
                    count = pub.publish_prepared(
                        prepared, time_ms=time_ms, engine_seq=seq, dp_rank=batch.dp_rank
                    )
                except MessageTooLargeError as exc:  # the others of the batch were produced
                    self._undecodable(seq, exc)
                    count = None
        if count is None:  # undecodable: what it changed is unknown
            self._lost(seq, seq)
            return
        self.sequence.relayed(seq, time_ms)
        self.txn.in_txn += 1
        self._tally.relayed += count
        if time_ms is not None:
            self._tally.behind_s = max(0.0, self._clock() - time_ms / 1000)

    def _decode(self, seq: int, payload: bytes) -> EngineBatch | None:
        """The batch, its events still vLLM's (checked as they are prepared), or None."""
        try:
            return self._read(payload)
        except Exception as exc:  # whatever a batch does, it stops no relay
            self._undecodable(seq, exc)
            return None

    def _undecodable(self, seq: int, exc: Exception) -> None:
        """Engine batch ``seq`` cannot be carried: said with the reason (its loss is
        recorded by the caller), so no replay can bring it back to stop the relay."""
        self.metrics.undecodable.labels(self.source).inc()
        reason = str(exc) if isinstance(exc, VllmEventError | PublishError) else repr(exc)
        logger.error(
            "relay %s: engine batch %d cannot be relayed (%.300s); recorded as lost",
            self.source,
            seq,
            reason,
        )

    def _lost(self, first: int, last: int) -> None:
        """Engine batches first..last cannot be recovered: every group is cleared."""
        self.txn.begin()
        pub = self._pub
        groups = pub.groups or [0]
        logger.error(
            "relay %s: engine batches %d..%d are lost (the engine no longer holds them); "
            "clearing the source's blocks in groups %s",
            self.source,
            first,
            last,
            groups,
        )
        pub.publish_events([EventsLost(first, last, group_idx=g) for g in groups], engine_seq=None)
        self.metrics.unrecoverable.labels(self.source).inc()
        # A range wider than any engine sends (its numbering jumped) counts as that bound.
        self.metrics.lost_batches.labels(self.source).inc(min(max(0, last - first + 1), MAX_GAP))
        self.sequence.skip_to(last)
        self.txn.in_txn += 1

    def _healthy(self) -> bool:
        """The engine's health route answered 200 when last asked (always true without
        one): read, never waited for (its watch asks off the loop, :mod:`.health`)."""
        if self.health is None:
            return True
        return self.health.healthy() is True

    def _busy_heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_heartbeat >= self.config.heartbeat_interval_s

    def _heartbeat(self, caught_up: bool = True) -> None:
        """The engine answered (or, ``caught_up`` False, sent a batch): a Heartbeat in the
        open transaction (committed by the caller), with the engine's latest load when one
        is read."""
        self.txn.begin()
        pub = self._pub
        group = min(pub.groups) if pub.groups else 0
        interval = int(self.config.heartbeat_interval_s * 1000)
        load = self.load.latest() if self.load is not None else None
        running, waiting = (load.running, load.waiting) if load is not None else (None, None)
        pub.publish_events([Heartbeat(group, interval, running, waiting)])
        self._last_heartbeat = time.monotonic()
        self.txn.in_txn += 1
        if caught_up:
            self._tally.behind_s = 0.0  # caught up (reported as the probe commits)

    # ------------------------------------------------------------------ helpers
    @property
    def _pub(self) -> KVEventPublisher:
        return self.txn.pub

    @property
    def _link(self) -> EngineLink | trtllm.TrtllmLink:
        assert self.link is not None
        return self.link

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


def ms_of(ts: float) -> int:
    return round(ts * 1000)
