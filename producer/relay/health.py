"""The engine's health route (``--health-url``, vLLM's ``/health``) watched off the relay's
loop: a thread asks it every interval, each request under a deadline for the whole of it
(:func:`~.http_get.get`), and the loop reads the latest verdict without waiting. A route
that answers slowly, a byte at a time or not at all makes the engine unhealthy, never the
relay's loop stall."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvledger.producer.relay.http_get import get

MAX_BYTES = 65_536  # a health answer's body: read, not kept


class HealthWatch:
    """Asks ``url`` every ``interval_s`` (each ask at most ``deadline_s``); :meth:`healthy`
    is the latest verdict while it is fresh: True (200), False (anything else), or None
    (none yet, or the last is older than two intervals and a deadline)."""

    def __init__(
        self,
        url: str,
        interval_s: float,
        deadline_s: float,
        on_unhealthy: Callable[[], None] | None = None,
    ) -> None:
        self.url, self.interval_s, self.deadline_s = url, max(interval_s, 0.2), deadline_s
        self.on_unhealthy = on_unhealthy
        self._verdict: tuple[bool, float] | None = None
        self._stop = threading.Event()
        self._asked = threading.Event()  # set after each ask
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvledger-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.deadline_s + 1.0)

    def healthy(self) -> bool | None:
        verdict = self._verdict
        if verdict is None or time.monotonic() - verdict[1] > 2 * self.interval_s + self.deadline_s:
            return None
        return verdict[0]

    def wait_asked(self, timeout: float) -> bool:
        """Until the next ask ends (or ``timeout``); whether one did."""
        self._asked.clear()
        return self._asked.wait(timeout)

    def ask(self) -> bool:
        """One ask of the route (its verdict kept as the latest)."""
        try:
            status, _ = get(self.url, self.deadline_s, MAX_BYTES)
            ok = status == 200
        except (OSError, ValueError):  # refused, timed out, reset, not HTTP
            ok = False
        if not ok and self.on_unhealthy is not None:
            self.on_unhealthy()
        self._verdict = (ok, time.monotonic())
        self._asked.set()
        return ok

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.ask()
            self._stop.wait(max(self.interval_s - (time.monotonic() - began), 0.05))
