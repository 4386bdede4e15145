"""The relay: one stock vLLM engine's ZMQ KV events into Kafka, nothing lost that the engine
still buffers, and exactly what could not be recovered said out loud.

One :class:`RankRelay` per data-parallel rank (its own source stream, sockets, producer and
thread). Its loop:

1. Start: open the rank's transactional producer (fencing an earlier relay of the same
   source and aborting whatever it left half published), read back from the topic where the
   source stands (:mod:`.position`), and resynchronise with the engine by replay:
   - no history: a new epoch, replay from 0;
   - history up to batch L: replay from L. Batch L with the time it was published with is
     the same engine process (its epoch goes on from L + 1); another time, or nothing at or
     after L, is a new process (a new epoch, replay from 0).
2. Live batches (:mod:`.sequence`): the next one is published; a duplicate (replay and live
   overlap) skipped; a gap asks the engine to replay from the last relayed + 1; a number
   going backwards is an engine restart: a new epoch (the index drops what the previous
   process held on tiers that die with it), then replay from 0.
3. A range the engine no longer holds (a replay that starts later than asked, or no replay
   at all) is published as ``EventsLost`` for every group the source uses: the index clears
   the source's blocks there, every tier, and records the range.
4. Publishing is transactional: each Kafka transaction holds whole engine batches (committed
   every ``commit_interval_s`` or ``commit_batches``), each message carrying its engine
   batch number. A relay killed at any instant leaves either whole batches or nothing, and
   its successor resumes after the last whole one. When Kafka is unreachable the relay stops
   reading (ZMQ's bounded queue then drops live batches), keeps retrying, and, once Kafka is
   back, replays from the last committed batch. It never exits on a broker outage.
5. Idle: at start, then every ``heartbeat_interval_s`` (0: never) without batches, it probes
   the engine's replay socket; an answer (which would also bring any missed batch) is
   published as a Heartbeat, silence is left silent. Stopping the relay is not the engine's
   goodbye: none is sent.
6. With ``health_url`` (the engine's HTTP health route), the relay says the engine is there
   only once that answers 200: its start-up resync waits for it, and an idle probe without
   it is skipped (silence). An engine's replay socket answers seconds before its HTTP
   server does; without the gate a starting engine's new life makes it live to routers
   that cannot reach it yet.
7. With ``engine_metrics_url`` (the engine's Prometheus route), a :class:`~.load.LoadReader` reads
   the engine's requests running and queued every heartbeat interval on its own thread, and
   every heartbeat carries the latest reading; heartbeats then go out each interval while
   the engine is busy too (in the transaction with its batches), so lookups answer a load
   at most an interval or two old.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

from confluent_kafka import KafkaException

from kvledger.producer.errors import MessageTooLargeError, PublishError
from kvledger.producer.publisher import KVEventPublisher
from kvledger.producer.relay import sglang, trtllm
from kvledger.producer.relay.config import RelayConfig
from kvledger.producer.relay.engine import EngineLink, ReplayTimeoutError, offset_endpoint
from kvledger.producer.relay.load import LoadReader
from kvledger.producer.relay.metrics import RelayMetrics, StreamTally
from kvledger.producer.relay.sequence import EngineSequence, Seen
from kvledger.producer.relay.transaction import RelayTransactions, StoppedError
from kvledger.producer.relay.wire import EngineBatch, read_batch, starts_cleared
from kvledger.producer.vllm import VllmEventError
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import EventsLost, Heartbeat

logger = logging.getLogger(__name__)

# The widest range of lost batches counted as such: 2**32 batches is over a year of an
# engine's steps at 100 a second; a wider jump is an engine's numbering, not its steps.
MAX_GAP = 1 << 32


class RankRelay:
    """One data-parallel rank's relay (see the module docstring)."""

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
                config.engine_metrics_url, config.heartbeat_interval_s,
                rank if config.dp_size > 1 else None, config.health_timeout_s,
                on_error=self.metrics.load_errors.labels(self.source).inc,
            )  # fmt: skip
        self.ready = threading.Event()  # set once resynchronised with the engine

    @property
    def committed_seq(self) -> int | None:
        """The last engine batch whose transaction is committed (readers can see it)."""
        return self.txn.committed_seq

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Relay until :meth:`stop`; survives broker outages and engine restarts."""
        cfg = self.config
        if cfg.engine == "trtllm":
            errors = self.metrics.poll_errors.labels(self.source)
            self.link = trtllm.TrtllmLink(cfg.endpoint, cfg.poll_interval_s, on_error=errors.inc)
        else:
            self.link = EngineLink(
                offset_endpoint(cfg.endpoint, self.rank),
                offset_endpoint(cfg.replay_endpoint, self.rank) if cfg.replay_endpoint else None,
                cfg.engine_topic,
                cfg.receive_hwm,
            )
        if self.load is not None:
            self.load.start()
        try:
            self.txn.connect()
            if not self._healthy():  # a starting engine is not there yet
                logger.warning(
                    "relay %s: waiting for the engine's health route %s to answer 200",
                    self.source, cfg.health_url,
                )  # fmt: skip
                while not self._healthy():
                    if self._stop.wait(max(cfg.heartbeat_interval_s, 0.2)):
                        return
            answered = self._resync_at_start()
            if answered and cfg.heartbeat_interval_s > 0:
                # Say at once that the engine is there (its replay socket just answered): a
                # relay restarted after the index's liveness window would otherwise leave
                # its live engine silent until the first interval passed.
                self._heartbeat()
                self._commit()
            self.ready.set()
            while not self._stop.is_set():
                self._step()
            self._commit()
        finally:
            if self.load is not None:
                self.load.stop()
            self.link.close()
            self.txn.close()

    # ------------------------------------------------------------------ resynchronising
    def _resync_at_start(self) -> bool:
        """Where the topic stands, then the engine's batches since; whether it answered."""
        position = self.txn.position
        pub = self._pub
        if position is None or position.engine_seq is None:
            if position is not None:
                pub.resume(position.epoch, position.next_seqs)
            else:
                pub.epoch = self._now_ms()
            logger.info("relay %s: no engine history on the topic; replaying from 0", self.source)
            self.txn.started(None)  # what the topic already has
            return self._replay_from(0, verify=None)
        pub.resume(position.epoch, position.next_seqs)
        self.txn.started(position.engine_seq)
        self.sequence.relayed(position.engine_seq, position.engine_time_ms)
        self.sequence.committed()
        logger.info(
            "relay %s: resuming epoch %d after engine batch %d",
            self.source, position.epoch, position.engine_seq,
        )  # fmt: skip
        return self._replay_from(position.engine_seq, verify=position.engine_time_ms)

    def _replay_from(self, start: int, verify: int | None = None, upto: int | None = None) -> bool:
        """Ask the engine for its batches from ``start`` and relay them; what it no longer
        holds before ``upto`` (a live batch known to exist) is recorded lost.

        ``verify``: the time of batch ``start``, already relayed: the answer must show it with
        that time for the engine process to be the same one (else it restarted). Returns
        whether the engine answered."""
        link = self._link
        self.metrics.replays.labels(self.source).inc()
        first = True
        answered = False
        tries = 3
        while tries:
            tries -= 1
            try:
                for seq, payload in link.replay(start, self.config.replay_timeout_ms):
                    answered = True
                    if first and verify is not None:
                        first = False
                        batch = self._decode(seq, payload)
                        same = batch is not None and seq == start and (_ms(batch.ts) == verify)
                        if same:
                            continue  # batch L itself, already published
                        if seq <= start:  # a new process has reached that number
                            self._engine_restarted(seq)
                            return self._replay_from(0)
                    first = False
                    self._offer(seq, payload, from_replay=True)
                answered = True
                break
            except ReplayTimeoutError as exc:
                if answered or not tries:
                    logger.warning("relay %s: replay from %d: %s", self.source, start, exc)
                    break
        if verify is not None and answered and first:
            # Nothing at or after the batch last published: a new engine process.
            self._engine_restarted(None)
            return self._replay_from(0)
        last = self.sequence.last
        if upto and (last is None or last < upto - 1):  # something before upto is missing
            self._lost((last + 1) if last is not None else 0, upto - 1)
        return answered

    def _engine_restarted(self, seen: int | None) -> None:
        pub = self._pub
        epoch = max(self._now_ms(), pub.epoch + 1)
        logger.warning(
            "relay %s: the engine restarted (batch numbers went back%s); new epoch %d",
            self.source, f" to {seen}" if seen is not None else "", epoch,
        )  # fmt: skip
        self.metrics.engine_restarts.labels(self.source).inc()
        self.txn.begin()
        pub.new_epoch(epoch)
        self.sequence.reset()

    # ------------------------------------------------------------------ the live loop
    def _step(self) -> None:
        cfg = self.config
        try:
            # With batches in an open transaction, none waits for more: committed as soon
            # as no other batch is already there (a busy engine's still share one).
            got = self._link.receive(0 if self.txn.open else 50)
            if got is None:
                self._tally.report()
                if self.txn.due(idle=True):
                    self._commit()
                idle = time.monotonic() - self._last_activity
                if cfg.heartbeat_interval_s > 0 and idle >= cfg.heartbeat_interval_s:
                    self._probe()
                return
            seq, payload = got
            self._offer(seq, payload, from_replay=False)
            if self.load is not None and self._busy_heartbeat_due():
                self._heartbeat(caught_up=False)  # the engine's load, while it is busy
            if self.txn.due(idle=False):
                self._commit()
        except (KafkaException, PublishError) as exc:  # a produce failed: start over
            self._abort(exc)

    def _offer(self, seq: int, payload: bytes, from_replay: bool) -> None:
        """One batch from the engine, live or replayed."""
        self._last_activity = time.monotonic()
        self._tally.received += 1
        batch = self._decode(seq, payload)
        time_ms = _ms(batch.ts) if batch is not None else None
        seen = self.sequence.classify(seq, time_ms if time_ms is not None else -1)
        if seen is Seen.DUPLICATE:
            return
        if seen is Seen.RESTART:
            self._engine_restarted(seq)
            self._replay_from(0, upto=seq)
            seen = self.sequence.classify(seq, time_ms if time_ms is not None else -1)
            if seen is not Seen.NEXT:
                return  # the replay brought it (or recorded it lost)
        elif seen is Seen.GAP and self.sequence.last is None and starts_cleared(batch):
            # First contact, and the stream starts from a clear: the batches numbered before
            # it hold nothing the index knew or needs (`kvledger republish` answers a first
            # replay with such a snapshot, numbered from its start-up time, not from 0).
            logger.info("relay %s: the stream starts at batch %d, from a clear", self.source, seq)
        elif seen is Seen.GAP:
            self.metrics.gaps.labels(self.source).inc()
            last = self.sequence.last
            start = last + 1 if last is not None else 0
            if from_replay:  # the engine no longer holds what came before this one
                self._lost(start, seq - 1)
            else:
                logger.info(
                    "relay %s: batches %d..%d missed; asking for replay",
                    self.source, start, seq - 1,
                )  # fmt: skip
                self._replay_from(start, upto=seq)
                again = self.sequence.classify(seq, time_ms if time_ms is not None else -1)
                if again is not Seen.NEXT:
                    return
        self._publish(seq, batch, time_ms)

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
            self.source, seq, reason,
        )  # fmt: skip

    def _lost(self, first: int, last: int) -> None:
        """Engine batches first..last cannot be recovered: every group is cleared."""
        self.txn.begin()
        pub = self._pub
        groups = pub.groups or [0]
        logger.error(
            "relay %s: engine batches %d..%d are lost (the engine no longer holds them); "
            "clearing the source's blocks in groups %s",
            self.source, first, last, groups,
        )  # fmt: skip
        pub.publish_events([EventsLost(first, last, group_idx=g) for g in groups], engine_seq=None)
        self.metrics.unrecoverable.labels(self.source).inc()
        # A range wider than any engine sends (its numbering jumped) counts as that bound.
        self.metrics.lost_batches.labels(self.source).inc(min(max(0, last - first + 1), MAX_GAP))
        self.sequence.skip_to(last)
        self.txn.in_txn += 1

    def _healthy(self) -> bool:
        """The engine's health route answers 200 (always true without one)."""
        url = self.config.health_url
        if url is None:
            return True
        try:
            with urllib.request.urlopen(url, timeout=self.config.health_timeout_s) as answer:
                if answer.status == 200:
                    return True
        except (OSError, ValueError):  # refused, timed out, an HTTP error status
            pass
        self.metrics.unhealthy.labels(self.source).inc()
        return False

    def _probe(self) -> None:
        """Idle: is the engine there? Its answer also brings any batch the SUB missed."""
        since = self._last_activity
        self._last_activity = time.monotonic()
        if not self._healthy():
            self._commit()
            return
        last = self.sequence.last
        link = self._link
        if isinstance(link, trtllm.TrtllmLink):  # polled: a good poll since is the answer
            answered = link.last_answer >= since and not link.failing
        elif self.config.replay_endpoint is None:
            return
        else:
            known = self.sequence.time_of(last) if last is not None else None
            if last is not None and known is not None:
                # The last batch too: is the engine still the process that sent it?
                answered = self._replay_from(last, verify=known)
            else:
                answered = self._replay_from(last + 1 if last is not None else 0)
        if answered:
            self._heartbeat()
        self._commit()

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

    # ------------------------------------------------------------------ transactions
    def _commit(self) -> None:
        self._tally.report()
        if not self.txn.open:
            return
        if self.txn.commit(self.sequence.last):
            self.sequence.committed()
        else:
            self._rewind_and_replay()

    def _abort(self, exc: BaseException) -> None:
        self.txn.abort(exc)
        self._rewind_and_replay()

    def _rewind_and_replay(self) -> None:
        """After an abort: the engine's batches again from the last committed one + 1."""
        self.sequence.rewind(self.txn.committed_seq)
        last = self.sequence.last
        self._replay_from(last + 1 if last is not None else 0)

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


def _ms(ts: float) -> int:
    return round(ts * 1000)


class Relay:
    """Every rank of one engine, one thread each."""

    def __init__(self, config: RelayConfig, metrics: RelayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or RelayMetrics()
        self.ranks = [RankRelay(config, r, self.metrics) for r in range(config.dp_size)]
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self) -> None:
        for rank in self.ranks:
            thread = threading.Thread(
                target=self._run, args=(rank,), name=f"kvledger-relay-{rank.source}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _run(self, rank: RankRelay) -> None:
        try:
            rank.run()
        except StoppedError:
            pass
        except BaseException as exc:  # reported by wait(); the other ranks go on
            logger.exception("relay %s stopped on an error", rank.source)
            self.errors.append(exc)

    def ready(self, timeout: float) -> bool:
        """Every rank has resynchronised with its engine (False on a timeout or an error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.errors:
            if all(r.ready.wait(0.05) for r in self.ranks):
                return True
        return False

    def stop(self, timeout: float = 30.0) -> None:
        for rank in self.ranks:
            rank.stop()
        for thread in self._threads:
            thread.join(timeout)

    def alive(self) -> bool:
        """Every rank is still relaying (a sidecar whose rank died should exit and be
        restarted)."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def __iter__(self) -> Iterator[RankRelay]:
        return iter(self.ranks)
