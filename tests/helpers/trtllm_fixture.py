"""A stand-in for `trtllm-serve`'s ``POST /kv_cache_events``: TensorRT-LLM itself has no
wheel on PyPI (its wheels live on NVIDIA's own index, which this machine cannot reach), so
the tests serve events in the JSON shape TensorRT-LLM's ``KVCacheEventSerializer``
(``tensorrt_llm/_utils.py``) writes, read from its source: ``{"event_id", "data",
"window_size", "attention_dp_rank"?}`` with ``created`` / ``stored`` (``stored_block``s of
``unique_token``s) / ``removed`` / ``updated`` (``event_diff``s) data. Each POST drains the
queue, as the server's does; it can answer 500s or HTML instead, and lose events.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.helpers.procs import free_port

Key = tuple[int, bytes, str, str]  # group, hash, medium, ownership


class TrtllmServe:
    """The endpoint and the engine behind it: what it stored, where, and the truth."""

    def __init__(self, block: int = 4, window: int = 4096, seed: int = 3) -> None:
        self.block, self.window = block, window
        self.rng = random.Random(seed)
        self.port = free_port()
        self.queue: list[dict[str, Any]] = []
        self.next_id = 0
        self.answer = "ok"  # or "500", "html"
        self.lock = threading.Lock()
        self.next_hash = 10
        self.levels: dict[int, int] = {}  # held hash -> cache level
        self.parents: dict[int, int | None] = {}
        self.log: list[tuple[int, int, dict[str, Any]]] = []  # (life, event_id, data)
        self.life = 0
        serve = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != "/kv_cache_events":
                    self.send_error(404)
                    return
                with serve.lock:
                    mode = serve.answer
                    events, serve.queue = (serve.queue, []) if mode == "ok" else ([], serve.queue)
                if mode == "500":
                    self.send_error(500, "engine busy")
                    return
                body = (
                    b"<html>maintenance</html>" if mode == "html" else json.dumps(events).encode()
                )
                self.send_response(200)
                ctype = "text/html" if mode == "html" else "application/json"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ the engine
    def emit(self, data: dict[str, Any], lose: bool = False, **fields: Any) -> int:
        """One event (``fields``: what else it says, as the engine would not)."""
        event = {"event_id": self.next_id, "data": data, "window_size": self.window, **fields}
        self.log.append((self.life, self.next_id, data))
        if not lose:
            with self.lock:
                self.queue.append(event)
        self.next_id += 1
        return self.next_id - 1

    def _hash(self) -> int:
        self.next_hash += 1
        h = (self.next_hash * 0x9E3779B97F4A7C15) % 2**64
        return h - 2**64 if h >= 2**63 else h  # size_t read as a signed int half the time

    def store(self, parent: int | None = None, n: int = 3, extra: bool = False,
              lose: bool = False) -> list[int]:  # fmt: skip
        hashes = [self._hash() for _ in range(n)]
        blocks = []
        for h in hashes:
            tokens = [{"type": "unique_token", "token_id": self.rng.randrange(1, 30_000),
                       "token_extra_id": 7 if extra else 0} for _ in range(self.block)]  # fmt: skip
            blocks.append({"type": "stored_block", "block_hash": h, "tokens": tokens,
                           "cache_level": 0, "priority": 35})  # fmt: skip
        self.emit({"type": "stored", "parent_hash": parent, "blocks": blocks}, lose)
        up = parent
        for h in hashes:
            self.levels[h], self.parents[h], up = 0, up, h
        return hashes

    def move(self, h: int, new: int) -> None:
        old = self.levels[h]
        diff = {"type": "event_diff", "new_value": new, "old_value": old}
        prio = {"type": "event_diff", "new_value": 35, "old_value": 35}
        self.emit({"type": "updated", "block_hash": h, "cache_level": diff, "priority": prio})
        self.levels[h] = new

    def remove(self, hashes: list[int]) -> None:
        self.emit({"type": "removed", "block_hashes": hashes})
        for h in hashes:
            self.levels.pop(h, None)

    def restart(self) -> None:
        """A new engine process: ids from 0, an empty cache."""
        self.life += 1
        self.next_id = 0
        self.levels.clear()
        self.emit({"type": "created", "num_blocks_per_cache_level": [128, 512]})


def truth(log: list[tuple[int, int, dict[str, Any]]], lost: set[tuple[int, int]]) -> dict[Key, int]:
    """The residencies the engine's events leave, read as docs/engines.md's table says: a
    restart ends GPU and CPU, a lost event ends everything and is not applied."""
    refs: Counter[Key] = Counter()
    where: dict[bytes, str] = {}
    life, losing = 0, False
    level = {0: "GPU", 1: "CPU"}
    for i, event_id, data in log:
        if i != life:
            refs, where, life = Counter(), {}, i
        if (i, event_id) in lost:
            if not losing:
                refs.clear()
            losing = True
            continue
        losing = False
        kind = data["type"]
        if kind == "stored":
            for b in data["blocks"]:
                h = (b["block_hash"] % 2**64).to_bytes(8, "big")
                refs[(0, h, level[b["cache_level"]], "")] += 1
                where[h] = level[b["cache_level"]]
        elif kind == "removed":
            for v in data["block_hashes"]:
                h = (v % 2**64).to_bytes(8, "big")
                key = (0, h, where.pop(h, "GPU"), "")
                refs[key] = max(0, refs[key] - 1)
        elif kind == "updated":
            h = (data["block_hash"] % 2**64).to_bytes(8, "big")
            old, new = (
                level[data["cache_level"]["old_value"]],
                level[data["cache_level"]["new_value"]],
            )
            refs[(0, h, old, "")] = max(0, refs[(0, h, old, "")] - 1)
            refs[(0, h, new, "")] += 1
            where[h] = new
    return {k: v for k, v in refs.items() if v > 0}
