"""TensorRT-LLM's KV cache events for `kvledger relay --engine trtllm`: polled over HTTP from
``trtllm-serve`` and read into kvledger's events.

``trtllm-serve`` drains its engine's event queue on each ``POST /kv_cache_events``: a JSON
list of events as TensorRT-LLM's ``KVCacheEventSerializer`` writes them (``tensorrt_llm/
_utils.py``) — ``{"event_id", "window_size", "attention_dp_rank"?, "data": {...}}`` where
``data`` is one of

- ``{"type": "created", "num_blocks_per_cache_level": [...]}`` (a cache was made: nothing
  to index);
- ``{"type": "stored", "parent_hash", "blocks": [{"type": "stored_block", "block_hash",
  "tokens": [{"type": "unique_token", "token_id", "token_extra_id"}], "cache_level",
  "priority"}]}``;
- ``{"type": "removed", "block_hashes": [...]}``;
- ``{"type": "updated", "block_hash", "cache_level": {"type": "event_diff", "old_value",
  "new_value"}, "priority": {...}}``.

What the relay makes of it (docs/engines.md, "Engines"):
- ``event_id`` is the engine's sequence: one event, one engine batch. There is no replay: an
  id skipped is lost at once (``EventsLost``), ids going back are an engine restart;
- ``cache_level`` 0 (the primary pool) is GPU, 1 (the secondary, host pool) is CPU; any
  other is refused by name;
- ``updated`` moving a block between levels is a removal on the old tier and a store on the
  new (with the block's tokens and parent when its store was seen, else a placeholder
  store); a priority change is nothing to index;
- ``removed`` says no tier: the block leaves the tier it was last stored or moved to (GPU
  for a block the relay never saw stored);
- ``window_size`` picks the group: the ``--group`` whose sliding window it is, else the
  lowest full-attention one, else 0;
- a token with a non-zero ``token_extra_id`` (multimodal or prompt-tuning inputs) gives
  its block an extra key: such blocks are found by hash, never by a token walk;
- hashes are 64-bit ints (either sign), kept as their 8 bytes.

Each event travels from the link to the reader as its own payload, wrapped with the time
it was polled (TensorRT-LLM's events carry none).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from kvledger.producer.relay.engine import ReplayTimeoutError
from kvledger.producer.relay.wire import TOO_DEEP, EngineBatch, checked
from kvledger.producer.vllm import VllmEventError, signed_hash_bytes
from kvledger.schemas.events import BlockRemoved, BlockStored, GroupSpec, KVEvent

logger = logging.getLogger(__name__)

LEVELS = {0: "GPU", 1: "CPU"}
# How much the relay remembers to turn a tier move into a store: each block's parent,
# tokens and tier, while it is held (a removal forgets it).
MAX_REMEMBERED = 1 << 17
# The most one poll's answer may hold (a poll every 0.2 s drains far less).
MAX_ANSWER_BYTES = 256 << 20


def level_of(value: object) -> str:
    medium = LEVELS.get(value) if type(value) is int else None
    if medium is None:
        raise VllmEventError(f"unknown TensorRT-LLM cache_level {value!r} (known: 0 GPU, 1 CPU)")
    return medium


class TrtllmReader:
    """One engine rank's events into kvledger's (stateful: see the module docstring)."""

    def __init__(self, groups: Sequence[GroupSpec] = ()) -> None:
        self.windows = {g.sliding_window: g.group_idx for g in groups if g.sliding_window}
        full = sorted(g.group_idx for g in groups if g.kind == "full_attention")
        self.default_group = full[0] if full else 0
        # (group, hash) -> (parent, tokens, medium) of blocks held
        self.blocks: dict[tuple[int, bytes], tuple[bytes | None, tuple[int, ...], str]] = {}

    def read_batch(self, payload: bytes) -> EngineBatch:
        try:
            wrapped = json.loads(payload)
            polled, event = float(wrapped["polled"]), wrapped["event"]
            data = event["data"]
            kind = data["type"]
        except RecursionError:
            raise VllmEventError(TOO_DEEP) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise VllmEventError(f"not a TensorRT-LLM KV cache event: {exc!r}") from None
        window = event.get("window_size")
        if window is not None and type(window) is not int:
            raise VllmEventError(f"window_size is not an int: {str(window)[:40]}")
        group = (
            self.default_group if window is None else self.windows.get(window, self.default_group)
        )
        rank = event.get("attention_dp_rank")
        if rank is not None and type(rank) is not int:
            raise VllmEventError(f"attention_dp_rank is not an int: {str(rank)[:40]}")
        try:
            events = list(self._events(kind, data, group))
        except VllmEventError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise VllmEventError(f"TensorRT-LLM {str(kind)[:40]} event: {str(exc)[:120]}") from None
        return checked(EngineBatch(polled, events, rank))

    def _events(self, kind: object, data: dict[str, Any], group: int) -> Iterator[KVEvent]:
        if kind == "created":
            return
        if kind == "stored":
            yield from self._stored(data, group)
        elif kind == "removed":
            by_medium: dict[str, list[bytes]] = {}
            for h in (signed_hash_bytes(v) for v in data["block_hashes"]):
                held = self.blocks.pop((group, h), None)
                by_medium.setdefault(held[2] if held else "GPU", []).append(h)
            for medium, hashes in by_medium.items():
                yield BlockRemoved(tuple(hashes), medium, group_idx=group)
        elif kind == "updated":
            level = data.get("cache_level")
            if level is None:
                return  # a priority change
            old, new = level_of(level["old_value"]), level_of(level["new_value"])
            if old == new:
                return
            h = signed_hash_bytes(data["block_hash"])
            yield BlockRemoved((h,), old, group_idx=group)
            held = self.blocks.get((group, h))
            if held is None:  # its store came before the relay: where it is, not what
                yield BlockStored((h,), None, (), 0, None, new, None, group_idx=group)
                return
            parent, tokens, _ = held
            self.blocks[(group, h)] = (parent, tokens, new)
            yield BlockStored((h,), parent, tokens, len(tokens), None, new, None, group_idx=group)
        else:
            raise VllmEventError(f"unknown TensorRT-LLM event type {kind!r:.40}")

    def _stored(self, data: dict[str, Any], group: int) -> Iterator[KVEvent]:
        parent = (
            signed_hash_bytes(data["parent_hash"]) if data.get("parent_hash") is not None else None
        )
        run: list[tuple[bytes, tuple[int, ...], str | None]] = []
        medium: str | None = None
        for block in data["blocks"]:
            h = signed_hash_bytes(block["block_hash"])
            tokens = [(t["token_id"], t.get("token_extra_id", 0)) for t in block["tokens"]]
            if any(type(t) is not int or type(x) is not int for t, x in tokens):
                raise VllmEventError("token ids are ints")
            extra = [x for _, x in tokens]
            key = json.dumps(["token_extra_ids", extra]) if any(extra) else None
            level = level_of(block.get("cache_level", 0))
            if medium is not None and level != medium:  # one store per tier
                yield from self._flush(run, parent, medium, group)
                parent, run = run[-1][0], []
            medium = level
            ids = tuple(t for t, _ in tokens)
            run.append((h, ids, key))
        if run and medium is not None:
            yield from self._flush(run, parent, medium, group)

    def _flush(
        self,
        run: list[tuple[bytes, tuple[int, ...], str | None]],
        parent: bytes | None,
        medium: str,
        group: int,
    ) -> Iterator[KVEvent]:
        """One store of consecutive blocks on one tier (their tokens end to end)."""
        size = len(run[0][1])
        if any(len(ids) != size for _, ids, _ in run):
            for i, (h, ids, key) in enumerate(run):  # blocks of mixed sizes: one store each
                up = parent if i == 0 else run[i - 1][0]
                yield from self._flush([(h, ids, key)], up, medium, group)
            return
        extra = tuple(k for _, _, k in run) if any(k for _, _, k in run) else None
        up = parent
        for h, ids, _ in run:
            if len(self.blocks) < MAX_REMEMBERED:
                self.blocks[(group, h)] = (up, ids, medium)
            up = h
        tokens = tuple(t for _, ids, _ in run for t in ids)
        yield BlockStored(
            tuple(h for h, _, _ in run),
            parent,
            tokens,
            size,
            None,
            medium,
            None,
            extra_keys=extra,
            group_idx=group,
        )


class TrtllmLink:
    """One engine rank polled over HTTP, in the shape of the relay's engine link: ``receive``
    yields one event at a time (its ``event_id`` as its number), ``replay`` has nothing to
    give. A failed poll (no answer, not 200, not a JSON list) is retried with a back-off up
    to ``max_backoff_s``, logged once per outage and counted (``poll_errors``)."""

    def __init__(
        self,
        endpoint: str,
        interval_s: float = 0.2,
        timeout_s: float = 5.0,
        max_backoff_s: float = 5.0,
        on_error: Any = None,
    ) -> None:
        self.url = endpoint.rstrip("/") + "/kv_cache_events"
        self.endpoint, self.replay_endpoint = endpoint, None
        self.interval_s, self.max_backoff_s = interval_s, max_backoff_s
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=timeout_s)
        self._queue: deque[tuple[int, bytes]] = deque()
        self._next_poll = 0.0
        self._backoff = 0.0
        self._on_error = on_error
        self.last_answer = 0.0  # monotonic time of the last good poll
        self.failing = False

    def receive(self, timeout_ms: int) -> tuple[int, bytes] | None:
        if not self._queue:
            wait = self._next_poll - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, timeout_ms / 1000))
                if self._next_poll > time.monotonic():
                    return None
            self._poll()
        return self._queue.popleft() if self._queue else None

    def _poll(self) -> None:
        now = time.monotonic()
        try:
            body = self._answer(now + self.timeout_s)
            events = json.loads(body)
            if not isinstance(events, list):
                raise ValueError(f"not a JSON list of events: {body[:120]!r}")
        except RecursionError:
            self._failed(now, ValueError(TOO_DEEP))
            return
        except (httpx.HTTPError, ValueError) as exc:
            self._failed(now, exc)
            return
        if self.failing:
            logger.info("polling %s works again", self.url)
        self.failing, self._backoff = False, 0.0
        self.last_answer = now
        self._next_poll = now + self.interval_s
        polled = time.time()
        for event in events:
            event_id = event.get("event_id") if isinstance(event, dict) else None
            if type(event_id) is not int or not 0 <= event_id < 1 << 63:
                logger.warning("skipping a TensorRT-LLM event without an event_id: %.120r", event)
                continue  # its number unknown: the next one shows the gap
            self._queue.append((event_id, json.dumps({"polled": polled, "event": event}).encode()))

    def _answer(self, deadline: float) -> bytes:
        """One poll's answer, read whole by ``deadline`` and within ``MAX_ANSWER_BYTES``
        (a trickling or endless answer is a failed poll, not a stalled relay)."""
        with self._client.stream("POST", self.url) as response:
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise ValueError(f"an answer over {MAX_ANSWER_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise ValueError(f"no whole answer within {self.timeout_s:g} s")
                chunks.append(chunk)
            body = b"".join(chunks)
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {body[:120]!r}")
            return body

    def _failed(self, now: float, exc: BaseException) -> None:
        self._backoff = min(self.max_backoff_s, max(self.interval_s, self._backoff * 2))
        self._next_poll = now + self._backoff
        if self._on_error is not None:
            self._on_error()
        if not self.failing:
            logger.warning("polling %s failed (%s); retrying with back-off", self.url, exc)
        self.failing = True

    def replay(self, start: int, timeout_ms: int = 2000) -> Iterator[tuple[int, bytes]]:
        raise ReplayTimeoutError("TensorRT-LLM keeps no replay: what was not polled is lost")

    def close(self) -> None:
        self._client.close()
