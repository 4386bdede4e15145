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
from collections.abc import Iterator

from confluent_kafka import KafkaException

from kvledger.producer.errors import PublishError
from kvledger.producer.relay import trtllm
from kvledger.producer.relay.config import RelayConfig
from kvledger.producer.relay.engine import EngineLink, ReplayTimeoutError, offset_endpoint
from kvledger.producer.relay.metrics import RelayMetrics
from kvledger.producer.relay.rank import RankState, ms_of
from kvledger.producer.relay.sequence import Seen
from kvledger.producer.relay.transaction import StoppedError
from kvledger.producer.relay.wire import starts_cleared

logger = logging.getLogger(__name__)


class RankRelay(RankState):
    """One data-parallel rank's relay (see the module docstring): the loop over its state."""

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
        if self.health is not None:
            self.health.start()
        try:
            self.txn.connect()
            if not self._healthy():  # a starting engine is not there yet
                logger.warning(
                    "relay %s: waiting for the engine's health route %s to answer 200",
                    self.source,
                    cfg.health_url,
                )
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
            if self.health is not None:
                self.health.stop()
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
            self.source,
            position.epoch,
            position.engine_seq,
        )
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
                        same = batch is not None and seq == start and (ms_of(batch.ts) == verify)
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
            self.source,
            f" to {seen}" if seen is not None else "",
            epoch,
        )
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
        time_ms = ms_of(batch.ts) if batch is not None else None
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
                    self.source,
                    start,
                    seq - 1,
                )
                self._replay_from(start, upto=seq)
                again = self.sequence.classify(seq, time_ms if time_ms is not None else -1)
                if again is not Seen.NEXT:
                    return
        self._publish(seq, batch, time_ms)

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
