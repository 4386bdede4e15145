"""Batches handed from an engine's scheduler thread to a background thread that writes them.

vLLM's own publisher does the same: the scheduler thread puts a batch on a queue and goes
back to scheduling; a thread of the publisher maps, encodes and produces it. Here
``put`` costs the caller a counter and a queue put while there is room (the
`vllm_publish` benchmark measures it; a Python semaphore alone cost ~0.8 µs) instead of
the whole write (~10 µs an event).

Nothing is lost and nothing reorders:
- a full queue (``capacity`` batches waiting) blocks ``put`` until the thread catches up
  (or, given ``wait_s``, that long at most: the item is then refused, and the caller knows
  it was not taken: the vLLM plugin records it lost);
- batches are written one at a time, in the order they were put;
- a batch that fails (an event that cannot be read, a message the topic refuses) is
  recorded, and the next ``put``, ``drain`` or the publisher's ``close`` raises it (the
  first one, once); the batches after it are still written;
- ``drain`` returns once every batch put before it is written (the publisher drains before
  any write that must come after them: a clear, a goodbye, a flush).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_STOP = object()
_SKIP = object()  # a number a bounded put gave up


class Handoff:
    """One background writer of put items (see the module docstring)."""

    def __init__(self, write: Callable[[Any], object], capacity: int, name: str) -> None:
        if capacity < 1:
            raise ValueError("a handoff holds at least one batch")
        self._write = write
        self._capacity = capacity
        # Items put and written: put numbers each item (count's next is atomic), and only
        # the writer thread moves `_written`, so a put sees the room left without a lock.
        self._puts = itertools.count()
        self._written = 0
        self._room = threading.Condition()  # a full queue's put waits on it
        self._waiting = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any, wait_s: float | None = None) -> bool:
        """Hand ``item`` over (blocking while the queue is full, for ``wait_s`` at most when
        given: False then, and the item is not taken); raises a failure recorded since the
        last one raised."""
        if self._failure is not None or self._stopped:
            self._raise()
        if wait_s is not None:
            return self._put_within(item, wait_s)
        n = next(self._puts)
        if n - self._written >= self._capacity:
            with self._room:
                self._waiting += 1
                try:
                    while n - self._written >= self._capacity:
                        # (a wake-up the writer sent just before this wait is not lost
                        # for long: the wait looks again every 50 ms)
                        self._room.wait(0.05)
                finally:
                    self._waiting -= 1
        self._queue.put(item)
        return True

    def _put_within(self, item: Any, wait_s: float) -> bool:
        n = next(self._puts)
        if n - self._written >= self._capacity:
            deadline = time.monotonic() + wait_s
            with self._room:
                self._waiting += 1
                try:
                    while n - self._written >= self._capacity:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            # Its number given up: written as nothing, so the count of
                            # items written still meets the count of numbers taken.
                            self._queue.put(_SKIP)
                            return False
                        self._room.wait(min(left, 0.05))
                finally:
                    self._waiting -= 1
        self._queue.put(item)
        return True

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every item put before this call is written; raises a recorded failure."""
        if not self._stopped:
            done = threading.Event()
            self._queue.put(done)
            if not done.wait(timeout):
                raise TimeoutError(f"batches still unwritten after {timeout} s")
        if self._failure is not None:
            self._raise()

    def stop(self, timeout: float | None = None) -> None:
        """Write what was put, then end the thread (idempotent); raises a recorded failure."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)
            self._thread.join(timeout)
        if self._failure is not None:
            self._raise()

    def _raise(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        raise RuntimeError("the publisher's writer has stopped")

    def _run(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if item is not _SKIP:
                    self._write(item)
            except Exception as exc:  # kept for the caller's next call
                logger.error("a handed-over batch was not written: %s", exc)
                if self._failure is None:
                    self._failure = exc
            finally:
                self._written += 1
                if self._waiting:
                    with self._room:
                        self._room.notify_all()
