"""The relay's two sockets on one engine rank: SUB on its publisher, DEALER on its replay.

Live frames are ``[topic, seq, payload]``. A replay request is ``[empty, start seq]``; the
engine answers ``[empty, topic, seq, payload]`` for each batch it still buffers from
``start`` on, then the end marker ``[empty, empty, eight 0xff bytes, empty]``. A malformed request
gets no answer at all, so every replay has a timeout; each request uses a fresh DEALER so a
late answer to an abandoned request can never be read as the answer to the next.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import zmq

from kvledger.producer.relay.wire import END_SEQ, seq_of
from kvledger.producer.vllm import VllmEventError

logger = logging.getLogger(__name__)


class ReplayTimeoutError(Exception):
    """The engine did not answer a replay request (or stopped answering mid-way)."""


def receive_message(sock: zmq.Socket[bytes], flags: int = 0) -> list[bytes]:
    """One whole multipart message's frames, each frame's own flag saying whether more
    follow (``recv_multipart`` reads the socket's RCVMORE option after every frame instead,
    a slower call)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame.bytes]
    while frame.more:  # the rest of a message arrives with its first frame: no wait
        frame = sock.recv(copy=False)
        frames.append(frame.bytes)
    return frames


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel rank's endpoint: the tcp port plus the rank (as vLLM offsets it)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r} has no tcp port")
        return f"{head}:{int(port) + rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} for rank {rank}")


class EngineLink:
    """One rank's stream: ``receive`` live batches, ``replay`` from a sequence number."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: bytes = b"",
        receive_hwm: int = 10_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        # Bounded: past this many unread batches ZMQ drops live ones; replay recovers them.
        self._sub.setsockopt(zmq.RCVHWM, receive_hwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)

    def receive(self, timeout_ms: int) -> tuple[int, bytes] | None:
        """The next live batch (seq, payload), or None after ``timeout_ms`` of silence.

        A message not in the protocol's shape is logged and skipped: its number is unknown,
        so the next good batch shows the gap and replay recovers what it was."""
        try:  # a busy stream has the next batch waiting: no poll for it
            frames = receive_message(self._sub, zmq.NOBLOCK)
        except zmq.Again:
            if not self._sub.poll(timeout_ms):
                return None
            frames = receive_message(self._sub)
        try:
            if len(frames) != 3:
                raise VllmEventError(f"a live message has 3 frames, not {len(frames)}")
            return seq_of(frames[1]), frames[2]
        except VllmEventError as exc:
            logger.warning("skipping a malformed message from %s: %s", self.endpoint, exc)
            return None

    def replay(self, start: int, timeout_ms: int = 2000) -> Iterator[tuple[int, bytes]]:
        """Every batch the engine still buffers from ``start`` on, in order; raises
        :class:`ReplayTimeoutError` when it does not answer within ``timeout_ms`` (per message)."""
        if self.replay_endpoint is None:
            raise ReplayTimeoutError("no replay endpoint configured")
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not dealer.poll(timeout_ms):
                    raise ReplayTimeoutError(
                        f"no answer from {self.replay_endpoint} within {timeout_ms} ms"
                    )
                frames = receive_message(dealer)
                try:
                    if len(frames) != 4 or frames[0]:
                        raise VllmEventError(f"a replay answer has 4 frames, got {len(frames)}")
                    if frames[2] == END_SEQ:
                        return
                    seq = seq_of(frames[2])
                except VllmEventError as exc:  # as good as no answer from here on
                    raise ReplayTimeoutError(f"malformed answer: {exc}") from exc
                yield seq, frames[3]
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)
