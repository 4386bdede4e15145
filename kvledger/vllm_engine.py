"""A stock vLLM engine's KV-event stream, simulated on real ZMQ sockets (the demo's relayed
engine, the relay's tests and its benchmark).

:class:`ZmqEngine` speaks vLLM 0.33.0's protocol (vllm/distributed/kv_events.py; the
tests run that file's own publisher against the relay, tests/test_relay.py): PUB
frames ``[topic, seq (8 bytes big-endian), payload]`` with seq from 0 per process; a ROUTER
replay socket that answers ``[empty, start seq]`` with ``[empty, topic, seq, payload]`` for
each batch still in its bounded buffer, then ``[empty, empty, eight 0xff bytes, empty]``.
Payloads are msgpack ``[ts, events, rank]``, events as tagged maps (vLLM 0.33.0) or
positional arrays (older engines), fields at their defaults left out. ``hide`` puts a batch
in the buffer without sending it live (a forced gap); ``restart`` is a new engine process.

:class:`VllmWireSink` lets a simulated fleet engine (kvledger.fleet) publish through such a
stream: its events leave in vLLM's shapes (int hashes, no position, no partial flag).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvledger.producer.tracker import (
    GroupOffloadConfig,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from kvledger.producer.vllm import FIELDS, REQUIRED
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, GroupSpec, KVEvent

END = b"\xff" * 8

# The defaults vLLM leaves out (omit_defaults) per event type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "BlockStored": {
        "extra_keys": None,
        "group_idx": None,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
        "locality": None,
        "ownership": None,
        "session_id": None,
        "lookahead_token_ids": None,
    },
    "BlockRemoved": {"group_idx": None, "locality": None, "ownership": None},
    "AllBlocksCleared": {},
}


@dataclass
class Event:
    """One vLLM event: its type and fields by vLLM's names."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


def stored(
    hashes: Sequence[int],
    parent: int | None,
    tokens: Sequence[int],
    size: int,
    medium: str | None = "GPU",
    **more: Any,
) -> Event:
    return Event(
        "BlockStored",
        {
            "block_hashes": list(hashes),
            "parent_block_hash": parent,
            "token_ids": list(tokens),
            "block_size": size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            **more,
        },
    )


def removed(hashes: Sequence[int], medium: str | None = "GPU", **more: Any) -> Event:
    return Event("BlockRemoved", {"block_hashes": list(hashes), "medium": medium, **more})


def cleared() -> Event:
    return Event("AllBlocksCleared")


def _vllm_class(kind: str) -> type[msgspec.Struct]:
    """vLLM's class for an event type: a msgspec struct of its name, fields in its order, those
    past the required ones None by default, encoded as vLLM 0.33.0 encodes it (a tagged map)."""
    names = FIELDS[kind]
    fields = [(n, Any) if i < REQUIRED[kind] else (n, Any, None) for i, n in enumerate(names)]
    return msgspec.defstruct(kind, fields, module=__name__, tag=True, omit_defaults=True, gc=False)


# The objects an embedded vLLM engine hands its publisher (vLLM's KVEventBatch and events).
VLLM_CLASSES: dict[str, type[msgspec.Struct]] = {kind: _vllm_class(kind) for kind in FIELDS}
KVEventBatch = msgspec.defstruct(
    "KVEventBatch",
    [("ts", float), ("events", list), ("data_parallel_rank", Any, None)],
    module=__name__,
    array_like=True,
    omit_defaults=True,
    gc=False,
)


def vllm_batch(ts: float, events: Iterable[Event], rank: int | None = 0) -> Any:
    """A batch as an embedded engine has it: vLLM's KVEventBatch of vLLM's event objects."""
    return KVEventBatch(ts, [VLLM_CLASSES[e.kind](**e.fields) for e in events], rank)


def encode_event(event: Event, positional: bool) -> Any:
    names = FIELDS[event.kind]
    defaults = _DEFAULTS[event.kind]
    if positional:
        values = [event.fields.get(n, defaults.get(n)) for n in names]
        while values and len(values) > 7 and values[-1] is None:  # trailing defaults left out
            values.pop()
        return [event.kind, *values]
    out: dict[str, Any] = {"type": event.kind}
    for n in names:
        value = event.fields.get(n, defaults.get(n))
        if n in defaults and value == defaults[n]:
            continue
        out[n] = value
    return out


def encode_batch(ts: float, events: Sequence[Event], rank: int | None, positional: bool) -> bytes:
    body: list[Any] = [ts, [encode_event(e, positional) for e in events]]
    if rank is not None:
        body.append(rank)
    return msgspec.msgpack.encode(body)


class ZmqEngine:
    """One engine rank: PUB on ``port``, ROUTER replay on ``replay_port``."""

    def __init__(  # noqa: PLR0913 - vLLM's ZmqEventPublisher's settings, and the wire's form
        self,
        port: int,
        replay_port: int,
        buffer_steps: int = 10_000,
        rank: int = 0,
        positional: bool = False,
        topic: bytes = b"",
        send_hwm: int = 100_000,
    ) -> None:
        self.port, self.replay_port = port, replay_port
        self.buffer_steps = buffer_steps
        self.rank = rank
        self.positional = positional
        self.topic = topic
        self.send_hwm = send_hwm
        self.published: list[tuple[int, float, list[Event]]] = []  # this process's batches
        self.incarnations: list[list[tuple[int, float, list[Event]]]] = [self.published]
        self._open()

    def _open(self) -> None:
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self.lock = threading.Lock()
        self.ctx = zmq.Context()  # one per process: terminating it frees the ports
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, self.send_hwm)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # As vLLM does: room for a whole replay and its end marker (ROUTER drops past it).
        self.router.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
        try:
            self.port = _bind(self.pub, f"tcp://127.0.0.1:{self.port}")
            self.replay_port = _bind(self.router, f"tcp://127.0.0.1:{self.replay_port}")
        except BaseException:
            # Left to the garbage collector, a context with open sockets blocks in term()
            # forever (CI once lost ten minutes to one).
            self.ctx.destroy(linger=0)
            raise
        self.running = True
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, events: Sequence[Event], hide: bool = False, ts: float | None = None) -> int:
        """One batch; ``hide``: buffered for replay but not sent live (a missed batch)."""
        ts = ts if ts is not None else time.time()
        seq = self.publish_payload(encode_batch(ts, events, self.rank, self.positional), hide)
        self.published.append((seq, ts, list(events)))
        return seq

    def publish_payload(self, payload: bytes, hide: bool = False) -> int:
        """One batch's bytes as they are (a test may send what no engine should)."""
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if not hide:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while self.running:
            if not poller.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM answers a malformed request with nothing
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self.lock:
                held = [(s, p) for s, p in self.buffer if s >= first]
            for seq, payload in held:
                self.router.send_multipart(
                    [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
            self.router.send_multipart([client, b"", b"", END, b""])

    def forget_before(self, seq: int) -> None:
        """The buffer no longer holds batches before ``seq`` (as if it had rolled over)."""
        with self.lock:
            while self.buffer and self.buffer[0][0] < seq:
                self.buffer.popleft()

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        self.thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()

    def restart(self) -> None:
        """A new engine process on the same ports: seq from 0, empty buffer."""
        self.stop()
        self.published = []
        self.incarnations.append(self.published)
        self._open()

    def close(self) -> None:
        self.stop()


def _bind(socket: zmq.Socket[bytes], endpoint: str) -> int:
    """Bind (port 0: any free one), waiting a moment for a port the previous process is still
    releasing; returns the port."""
    deadline = time.monotonic() + 10
    if endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    while True:
        try:
            socket.bind(endpoint)
            bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            return int(bound.rpartition(":")[2])
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def to_vllm(event: KVEvent) -> Event | None:
    """A kvledger event in the shape a stock vLLM engine sends it (None: not on its wire)."""
    if isinstance(event, BlockStored):
        extra = (
            [None if e is None else json.loads(e) for e in event.extra_keys]
            if event.extra_keys is not None
            else None
        )
        parent = event.parent_block_hash
        more = {
            "group_idx": event.group_idx,
            "kv_cache_spec_kind": event.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": event.kv_cache_spec_sliding_window,
            "locality": event.locality,
            "ownership": event.ownership,
            "lora_name": event.lora_name,
            "extra_keys": extra,
        }
        return stored(
            [_int_hash(h) for h in event.block_hashes],
            _int_hash(parent) if parent is not None else None,
            event.token_ids,
            event.block_size,
            event.medium,
            **{k: v for k, v in more.items() if v is not None},
        )
    if isinstance(event, BlockRemoved):
        more = {
            "group_idx": event.group_idx,
            "locality": event.locality,
            "ownership": event.ownership,
        }
        return removed(
            [_int_hash(h) for h in event.block_hashes],
            event.medium,
            **{k: v for k, v in more.items() if v is not None},
        )
    if isinstance(event, AllBlocksCleared):
        return cleared()
    return None  # announcements, heartbeats, goodbyes: a relay speaks for the engine


def _int_hash(digest: bytes) -> int:
    """vLLM's default wire form of a hash: the digest's last 8 bytes as an unsigned int."""
    return int.from_bytes(digest[-8:], "big")


class VllmWireSink:
    """An event sink (kvledger.sinks.EventSink) for a simulated fleet engine that publishes
    through a :class:`ZmqEngine`: one engine batch per publish call, in vLLM's shapes.
    ``hide(seq)`` says which batches are kept from the live stream (forced gaps)."""

    def __init__(self, engine: ZmqEngine, hide: Callable[[int], bool] | None = None) -> None:
        self._tracker = OffloadingEventsTracker()
        self.engine = engine
        self.hide = hide or (lambda seq: False)
        self.hidden: list[int] = []

    @property
    def tracker(self) -> OffloadingEventsTracker:
        return self._tracker

    def announce_groups(self, group_configs: Iterable[GroupOffloadConfig]) -> None:
        for cfg in group_configs:
            self._tracker.set_group_spec(cfg.group_idx, cfg.kv_event_group_spec)

    def announce_group_spec(self, spec: GroupSpec) -> None:
        self._tracker.set_group_spec(
            spec.group_idx, OffloadingEventGroupSpec(spec.kind, spec.sliding_window)
        )

    def publish(self, offloading_events: Iterable[OffloadingEvent]) -> int:
        return self.publish_events(self._tracker.take_events(offloading_events))

    def publish_events(self, events: Iterable[KVEvent]) -> int:
        wire = [w for w in (to_vllm(e) for e in events) if w is not None]
        if not wire:
            return 0
        hide = self.hide(self.engine.seq)
        seq = self.engine.publish(wire, hide=hide)
        if hide:
            self.hidden.append(seq)
        return len(wire)
