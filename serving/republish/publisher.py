"""The ZMQ side of `kvledger republish`: each source's stream on vLLM's sockets.

Per source given an endpoint, as a vLLM engine binds them (shared/VLLM_FACTS.md):

- a PUB socket sending ``[topic, seq (8 bytes big-endian), payload]``;
- a ROUTER replay socket: ``[empty, start seq]`` is answered with every retained batch from
  ``start`` as ``[empty, topic, seq, payload]``, then ``[empty, empty, ff*8, empty]``.

And one multiplexed PUB for every source, topics ``kv@<source>@<model>`` (llm-d's).

Sequence numbers count batches per source from ``start-up milliseconds << 20``: dense while
the process runs, and past every number an earlier run sent (a subscriber never sees them go
back, which vLLM's wire reads as an engine restart). What a source's replay retains is its
last ``buffer_steps`` batches (and ``buffer_bytes``); a request older than that is answered
from the source's newest snapshot (its holdings restated: :mod:`.feed`), made then if none
is retained. The PUB sockets are XPUBs: a new subscription (Dynamo's indexer has no replay
of its own worth the name) is answered with a snapshot, at most one per source per
``snapshot_interval_s``. A slow subscriber loses what its high-water mark cannot hold (a
PUB does not tell the sender); it sees the gap and asks replay, and what is sent again is
counted per source. Nothing a subscriber sends blocks the others or the index:

- a replay answer is sent without waiting (``NOBLOCK``): a peer whose queue is full (its
  high-water mark, one whole answer, reached because it asks and does not read) has the
  answer cut there and counted (``cut``), and the loop goes on;
- the retained batches are shared, never copied per answer (zero-copy frames over the
  ring's bytes): what many peers have queued costs the ring once, plus a few bytes a frame;
- requests waiting for a snapshot are held once per peer, at most ``MAX_PARKED`` per
  source (more are cut and counted);
- answers are sent a slice at a time, every answer under way in turn, at most
  ``FRAMES_PER_TURN`` frames between two looks at the sockets: a hundred peers asking for
  the whole ring at once delay the live stream and an honest replay by a slice, not by
  every answer (at most ``MAX_SENDING`` answers under way; more are cut and counted).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import zmq

from kvledger.consumer import metrics
from kvledger.serving.republish.events import encode_batch
from kvledger.serving.republish.feed import Feed, Output
from kvledger.serving.router.index import RouterIndex

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
SNAPSHOT_EVENTS = 1000  # events per batch of a snapshot
REQUESTS_PER_TURN = 64  # replay requests read per socket per loop turn
TICK_S = 0.2  # how often liveness is checked
MAX_PARKED = 256  # replay peers waiting for one source's snapshot
# Replay answers are sent a slice at a time, every answer in turn, so that no number of them
# holds the loop (the live stream, new requests) for long: at most FRAMES_PER_TURN frames a
# turn, ANSWER_SLICE of each answer; at most MAX_SENDING answers under way (more are cut).
FRAMES_PER_TURN, ANSWER_SLICE, MAX_SENDING = 512, 32, 4096


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one source is republished: its PUB address and replay address (or None)."""

    source: str
    pub: str
    replay: str | None = None


@dataclass(slots=True)
class Outlet:
    """One source's numbered stream and what its replay retains."""

    source: str
    next_seq: int
    keep: bool  # retain batches for replay
    steps: int
    max_bytes: int
    ring: deque[tuple[int, bytes]] = field(default_factory=deque)
    ring_bytes: int = 0
    snapshot_seq: int | None = None  # first batch of the newest snapshot retained
    last_snapshot: float = float("-inf")  # monotonic
    topic: bytes = b""
    mux_topic: bytes = b""

    def number(self, payload: bytes, starts_snapshot: bool) -> int:
        seq = self.next_seq
        self.next_seq += 1
        if starts_snapshot:
            self.snapshot_seq = seq
        if self.keep:
            self.ring.append((seq, payload))
            self.ring_bytes += len(payload)
            while len(self.ring) > self.steps or (
                self.ring_bytes > self.max_bytes and len(self.ring) > 1
            ):
                old, data = self.ring.popleft()
                self.ring_bytes -= len(data)
                if old == self.snapshot_seq:
                    self.snapshot_seq = None
        return seq

    def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The retained batches a replay from ``start`` gets; None when ``start`` is older
        than what is retained and no snapshot is (one must be made)."""
        if start >= self.next_seq:
            return []
        first = self.ring[0][0] if self.ring else self.next_seq
        if start < first:
            if self.snapshot_seq is None:
                return None
            start = self.snapshot_seq
        # The ring's numbers are dense: the answer starts at a known place in it.
        return list(itertools.islice(self.ring, start - first, None))


@dataclass(slots=True)
class Answer:
    """A replay answer under way: the retained batches it sends (shared with the ring), and
    how many have gone."""

    source: str
    peer: bytes
    batches: list[tuple[int, bytes]]
    resent: bool  # what it sends is what the peer missed (counted as resent)
    sent: int = 0


class Publisher:
    """Publishes a :class:`Feed`'s outputs (see the module doc); one thread owns the
    sockets."""

    def __init__(  # noqa: PLR0913 - kvledger republish's options, keyword with defaults
        self,
        index: RouterIndex,
        endpoints: Iterable[Endpoint],
        mux: str | None = None,
        silent_after_s: float = 30.0,
        topic: str = "",
        buffer_steps: int = 10_000,
        buffer_bytes: int = 64 << 20,
        hwm: int = 100_000,
        snapshot_interval_s: float = 1.0,
    ) -> None:
        self.index = index
        self.endpoints = {e.source: e for e in endpoints}
        self.mux_address = mux
        self.topic = topic.encode()
        self.buffer_steps, self.buffer_bytes, self.hwm = buffer_steps, buffer_bytes, hwm
        self.snapshot_interval_s = snapshot_interval_s
        self.feed = Feed(index, self._wanted, timedelta(seconds=silent_after_s))
        self.base_seq = int(time.time() * 1000) << 20
        self.outlets: dict[str, Outlet] = {}
        self._ctx = zmq.Context()
        self._pubs: dict[str, zmq.Socket[bytes]] = {}
        self._replays: dict[zmq.Socket[bytes], str] = {}
        self._replay_of: dict[str, zmq.Socket[bytes]] = {}
        self._mux: zmq.Socket[bytes] | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._due: dict[str, float] = {}  # snapshots asked for: source -> not before
        self._parked: dict[str, dict[bytes, None]] = {}  # replay peers waiting for a snapshot
        self._sending: deque[Answer] = deque()  # replay answers under way, in turn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def _wanted(self, source: str) -> bool:
        return self.mux_address is not None or source in self.endpoints

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """Bind every socket (an address no socket can use fails here), observe the index,
        and publish from a thread: first a snapshot of every source."""
        try:
            self._bind_all()
        except BaseException:
            # Sockets left open block the context's term() when the collector gets to it.
            self._ctx.destroy(linger=0)
            raise
        self.feed.wake = self._wake
        with self.index.lock:
            self.index.observer = self.feed
            for source in sorted(set(self.endpoints) | set(self.feed.known())):
                self.feed.out.append(self.feed.snapshot(source))
        self._thread = threading.Thread(target=self._run, name="kvledger-republish", daemon=True)
        self._thread.start()

    def _bind_all(self) -> None:
        for e in self.endpoints.values():
            pub = self._xpub(e.pub)
            self._pubs[e.source] = pub
            if e.replay is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # One whole answer queued per peer at most: a peer that asks and does
                # not read has the rest of its answers cut, not kept in memory.
                replay.setsockopt(zmq.SNDHWM, self.buffer_steps + 2)
                replay.setsockopt(zmq.RCVHWM, 1000)
                # Every frame by reference (the ring's bytes), whatever its size.
                replay.copy_threshold = 0
                replay.bind(e.replay)
                self._replays[replay] = e.source
                self._replay_of[e.source] = replay
        if self.mux_address is not None:
            self._mux = self._xpub(self.mux_address)

    def _xpub(self, address: str) -> zmq.Socket[bytes]:
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.bind(address)
        return pub

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self.index.lock:
            if self.index.observer is self.feed:
                self.index.observer = None
        self._ctx.destroy(linger=0)
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        # A full buffer: a wake-up is already waiting (closed: the publisher stopped).
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        poller = zmq.Poller()
        for pub in self._pubs.values():
            poller.register(pub, zmq.POLLIN)
        if self._mux is not None:
            poller.register(self._mux, zmq.POLLIN)
        for replay in self._replays:
            poller.register(replay, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = 0.0
        while not self._stop.is_set():
            try:
                # Answers under way: only a look at the sockets between their slices.
                wait_ms = 0 if self._sending else int(TICK_S * 1000)
                ready = dict(poller.poll(timeout=wait_ms))
                if self._wake_r.fileno() in ready:
                    self._drain_wake()
                requests = self._read(ready)
                now = time.monotonic()
                with self.index.lock:
                    if now >= next_tick:
                        next_tick = now + TICK_S
                        # A mapped source the index no longer knows is told it holds
                        # nothing (once), as a silent one is.
                        self.feed.tick(set(self.feed.known()) | set(self.endpoints))
                    for source in [s for s, at in self._due.items() if at <= now]:
                        del self._due[source]
                        self._snapshot_now(source, now)
                    outputs = self.feed.take()
                for output in outputs:
                    self._publish(output)
                for outlet, peer, start in requests:
                    self._answer(outlet, peer, start)
                self._answer_parked()
                self._send_answers()
            except Exception as exc:  # a bug: say so, and stop (as the router tail does)
                logger.exception("republish stopped")
                self.error = f"{type(exc).__name__}: {exc}"
                return

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _read(self, ready: dict[object, int]) -> list[tuple[str, bytes, int]]:
        """Subscriptions (each asks a snapshot) and replay requests (returned)."""
        now = time.monotonic()
        for source, pub in self._pubs.items():
            if pub in ready and any(m[:1] == b"\x01" for m in _recv_some(pub)):
                self._ask_snapshot(source, now)
        if self._mux is not None and self._mux in ready:
            for message in _recv_some(self._mux):
                if message[:1] == b"\x01":
                    self._subscribed_to_mux(message[1:], now)
        requests = []
        for replay, source in self._replays.items():
            if replay in ready:
                requests += [(source, *r) for r in _replay_requests(replay)]
        return requests

    def _subscribed_to_mux(self, prefix: bytes, now: float) -> None:
        """A subscription to the multiplexed PUB: a snapshot of each source it covers."""
        with self.index.lock:
            known = self.feed.known()
        for source in known:
            if self._outlet(source).mux_topic.startswith(prefix):
                self._ask_snapshot(source, now)

    def _ask_snapshot(self, source: str, now: float) -> None:
        outlet = self._outlet(source)
        at = max(now, outlet.last_snapshot + self.snapshot_interval_s)
        self._due[source] = min(self._due.get(source, at), at)

    def _snapshot_now(self, source: str, now: float) -> None:
        self._outlet(source).last_snapshot = now
        self.feed.out.append(self.feed.snapshot(source))

    # ------------------------------------------------------------------ sending
    def _outlet(self, source: str) -> Outlet:
        outlet = self.outlets.get(source)
        if outlet is None:
            e = self.endpoints.get(source)
            outlet = self.outlets[source] = Outlet(
                source,
                self.base_seq,
                e is not None and e.replay is not None,
                self.buffer_steps,
                self.buffer_bytes,
                topic=self.topic,
            )
        return outlet

    def _publish(self, output: Output) -> None:
        outlet = self._outlet(output.source)
        outlet.mux_topic = f"kv@{output.source}@{output.model}".encode()
        if output.snapshot:
            outlet.last_snapshot = time.monotonic()
            metrics.REPUBLISH_SNAPSHOTS.inc()
        events = output.resolved()
        step = SNAPSHOT_EVENTS if output.snapshot else max(len(events), 1)
        for i in range(0, max(len(events), 1), step):
            payload = encode_batch(output.ts, events[i : i + step], output.dp_rank)
            seq = outlet.number(payload, output.snapshot and i == 0).to_bytes(8, "big")
            pub = self._pubs.get(output.source)
            if pub is not None:
                pub.send_multipart([outlet.topic, seq, payload])
            if self._mux is not None:
                self._mux.send_multipart([outlet.mux_topic, seq, payload])
            metrics.REPUBLISH_BATCHES.inc()

    def _answer(self, source: str, peer: bytes, start: int, asked: bool = True) -> None:
        """Answer a replay from ``start``. ``asked``: the start is the subscriber's own, so
        the retained batches from it are what it missed (counted resent); false for a
        parked request given the snapshot made for it (a snapshot is not a resend)."""
        outlet = self._outlet(source)
        missed = asked and start >= (outlet.ring[0][0] if outlet.ring else outlet.next_seq)
        batches = outlet.replay(start)
        if batches is None:  # older than retained, no snapshot kept: make one first
            parked = self._parked.setdefault(source, {})
            if peer not in parked and len(parked) >= MAX_PARKED:
                metrics.REPUBLISH_REPLAYS.labels("cut").inc()
                return
            parked[peer] = None  # once per peer, in the order they asked
            self._due[source] = time.monotonic()
            self._wake()
            return
        if len(self._sending) >= MAX_SENDING:
            metrics.REPUBLISH_REPLAYS.labels("cut").inc()
            return
        self._sending.append(Answer(source, peer, batches, missed and bool(batches)))

    def _send_answers(self) -> None:
        """A slice of each answer under way, in turn, up to FRAMES_PER_TURN frames; an
        answer whose peer cannot take more (its queue full, or gone) is cut there."""
        budget = FRAMES_PER_TURN
        while self._sending and budget > 0:
            answer = self._sending.popleft()
            replay = self._replay_of[answer.source]
            topic = self._outlet(answer.source).topic
            upto = min(answer.sent + min(ANSWER_SLICE, budget), len(answer.batches))
            try:
                # Never waits: a peer that cannot take more raises.
                for seq, payload in answer.batches[answer.sent : upto]:
                    replay.send_multipart(
                        [answer.peer, b"", topic, seq.to_bytes(8, "big"), payload],
                        zmq.NOBLOCK,
                        copy=False,
                    )
                budget -= upto - answer.sent
                answer.sent = upto
                if upto < len(answer.batches):
                    self._sending.append(answer)
                    continue
                replay.send_multipart([answer.peer, b"", b"", END_SEQ, b""], zmq.NOBLOCK)
                budget -= 1
                metrics.REPUBLISH_REPLAYS.labels("answered").inc()
                if answer.resent:
                    metrics.REPUBLISH_RESENT.labels(answer.source).inc(len(answer.batches))
            except zmq.ZMQError:  # the peer is gone or cannot take more: its answer is cut
                metrics.REPUBLISH_REPLAYS.labels("cut").inc()

    def _answer_parked(self) -> None:
        for source in list(self._parked):
            if source in self._due:
                continue  # its snapshot is not made yet
            outlet = self._outlet(source)
            # From the snapshot just made (or, were it already past the buffer, from the
            # oldest batch retained): never parked again.
            start = outlet.snapshot_seq
            if start is None:
                start = outlet.ring[0][0] if outlet.ring else outlet.next_seq
            for peer in self._parked.pop(source):
                self._answer(source, peer, start, asked=False)


def _replay_requests(replay: zmq.Socket[bytes]) -> list[tuple[bytes, int]]:
    """(peer, start sequence) of the replay requests waiting, at most REQUESTS_PER_TURN; a
    malformed one is counted and gets no answer, as vLLM's."""
    requests = []
    for _ in range(REQUESTS_PER_TURN):
        try:
            frames = replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        request = replay_request(frames)
        if request is None:
            metrics.REPUBLISH_REPLAYS.labels("malformed").inc()
            continue
        requests.append(request)
    return requests


def replay_request(frames: list[bytes]) -> tuple[bytes, int] | None:
    """(peer, start sequence) of a replay request as a ROUTER reads it (``[peer, empty,
    8-byte start]``); None for anything else."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def _recv_some(sock: zmq.Socket[bytes]) -> list[bytes]:
    out = []
    for _ in range(REQUESTS_PER_TURN):
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out
