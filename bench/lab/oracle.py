"""What each engine held, from the engines' own ZMQ event streams, recorded by the lab: the
*available* reuse of a request is the longest prefix any live engine held when it was sent
(the best any router could have done).

Independent of kvledger on purpose: the batches are read with plain msgpack, and blocks are
keyed by their content (the whole token prefix up to and including the block), so no hash
function or index rule of kvledger's is involved.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import msgspec
import zmq

_decode = msgspec.msgpack.Decoder().decode


def prefix_keys(token_ids: list[int], block_size: int) -> list[int]:
    """The content key of each full block of a prompt."""
    keys: list[int] = []
    key = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, tuple(token_ids[start : start + block_size])))
        keys.append(key)
    return keys


class _Held:
    def __init__(self) -> None:
        self.content: dict[int, int] = {}  # engine block hash -> content key (kept)
        self.held: dict[int, int] = {}  # engine block hash -> content key, while held
        self.keys: dict[int, int] = {}  # content key -> holders among held hashes
        self.removed = 0

    def store(self, hashes: list[int], parent: int | None, tokens: list[int], size: int) -> None:
        key = 0 if parent is None else self.content.get(parent)
        if key is None:
            return  # a parent never seen: its prefix cannot be named
        for i, block_hash in enumerate(hashes):
            key = hash((key, tuple(tokens[i * size : (i + 1) * size])))
            self.content[block_hash] = key
            if block_hash not in self.held:
                self.held[block_hash] = key
                self.keys[key] = self.keys.get(key, 0) + 1

    def remove(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            self.removed += 1
            key = self.held.pop(block_hash, None)
            if key is not None:
                left = self.keys[key] - 1
                if left:
                    self.keys[key] = left
                else:
                    del self.keys[key]

    def clear(self) -> None:
        self.held.clear()
        self.keys.clear()


class Oracle:
    """Subscribes to every engine's PUB endpoint in one thread."""

    def __init__(self, endpoints: list[str], block_size: int) -> None:
        self.block_size = block_size
        self._held = [_Held() for _ in endpoints]
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._sockets = []
        for endpoint in endpoints:
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(endpoint)
            self._sockets.append(sock)
        self._stop = threading.Event()
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="lab-oracle", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        index = {sock: i for i, sock in enumerate(self._sockets)}
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._apply(index[sock], frames[-1])

    def _apply(self, engine: int, payload: bytes) -> None:
        batch = _decode(payload)
        with self._lock:
            self.batches += 1
            held = self._held[engine]
            for event in batch[1]:
                kind = event.get("type") if isinstance(event, dict) else event[0]
                if isinstance(event, list):
                    continue  # the lab's engines send tagged maps (vLLM 0.32+)
                if kind == "BlockStored":
                    held.store(
                        list(event["block_hashes"]),
                        event.get("parent_block_hash"),
                        list(event["token_ids"]),
                        int(event["block_size"]),
                    )
                elif kind == "BlockRemoved":
                    held.remove(event["block_hashes"])
                elif kind == "AllBlocksCleared":
                    held.clear()

    def forget(self, engine: int) -> None:
        """An engine's process ended: what it held is gone."""
        with self._lock:
            self._held[engine].clear()

    def available(self, token_ids: list[int], live: list[bool]) -> tuple[int, int]:
        """(tokens, engine) of the longest held prefix among live engines, capped as vLLM
        caps a hit (the last token is always computed); (0, -1) when none holds any."""
        keys = prefix_keys(token_ids, self.block_size)
        cap = (len(token_ids) - 1) // self.block_size
        best, who = 0, -1
        with self._lock:
            for engine, held in enumerate(self._held):
                if not live[engine]:
                    continue
                n = 0
                for key in keys[:cap]:
                    if key not in held.keys:
                        break
                    n += 1
                if n > best:
                    best, who = n, engine
        return best * self.block_size, who

    def held_hashes(self, engine: int) -> set[int]:
        """The engine's block hashes it holds now, as its stream says."""
        with self._lock:
            return set(self._held[engine].held)

    def removals(self, engine: int) -> int:
        """BlockRemoved hashes the engine has sent (evictions)."""
        with self._lock:
            return self._held[engine].removed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close(linger=0)
        self._context.term()
