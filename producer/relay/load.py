"""An engine's load, read from its Prometheus metrics for the relay's heartbeats.

vLLM exports the requests each engine core is running and has queued as two gauges,
``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, labelled ``model_name`` and
``engine`` (the core's index: the data-parallel rank behind that API server). A
:class:`LoadReader` reads them on its own thread every interval, so a slow or hostile metrics
route never holds up the relay's loop: the loop takes the latest reading, or nothing when
it is older than two intervals. What it reads is bounded (:data:`MAX_BYTES`, a timeout), and
text that is not a reading is no reading, never an exception in the relay.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvledger.producer.relay.http_get import get

logger = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
MAX_BYTES = 4 << 20  # vLLM's whole /metrics is ~100 KiB; more is not a metrics page
MAX_REQUESTS = (1 << 31) - 1  # what the contract's int holds


@dataclass(frozen=True, slots=True)
class Load:
    running: int
    waiting: int


def parse_load(text: str, rank: int | None = None) -> Load | None:
    """The running and waiting requests in a Prometheus text page: the samples of engine
    ``rank`` (its ``engine`` label), or of every engine summed (``rank`` None). None when
    neither gauge is there or a value is not a count."""
    sums = {RUNNING: 0.0, WAITING: 0.0}
    found = False
    for line in text.splitlines():
        if not line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            continue
        name, labels, value = _sample(line)
        if name not in sums:  # another metric with the same prefix (…_by_reason)
            continue
        if rank is not None and labels.get("engine") != str(rank):
            continue
        if value is None or not math.isfinite(value) or value < 0:
            return None
        sums[name] += value
        found = True
    if not found:
        return None
    running, waiting = round(sums[RUNNING]), round(sums[WAITING])
    if running > MAX_REQUESTS or waiting > MAX_REQUESTS:
        return None
    return Load(running, waiting)


def _sample(line: str) -> tuple[str, dict[str, str], float | None]:
    """``name{labels} value [timestamp]`` as its parts (a malformed line: value None)."""
    brace = line.find("{")
    labels: dict[str, str] = {}
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return line[:brace], labels, None
        name, rest = line[:brace], line[close + 1 :]
        for pair in line[brace + 1 : close].split(","):
            key, sep, quoted = pair.partition("=")
            if sep and len(quoted) >= 2 and quoted[0] == quoted[-1] == '"':
                labels[key.strip()] = quoted[1:-1]
    else:
        name, _, rest = line.partition(" ")
        rest = " " + rest
    fields = rest.split()
    try:
        return name, labels, float(fields[0]) if fields else None
    except ValueError:
        return name, labels, None


class LoadReader:
    """Reads ``url`` every ``interval_s`` on a daemon thread; :meth:`latest` is the newest
    reading younger than two intervals. ``on_error`` is told of each failed read."""

    def __init__(  # noqa: PLR0913 - the route's reading (4), its error count, the tests' clock
        self,
        url: str,
        interval_s: float,
        rank: int | None = None,
        timeout_s: float = 1.0,
        on_error: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.interval_s = max(interval_s, 0.1)
        self.rank = rank
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.clock = clock
        self._reading: tuple[Load, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvledger-load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1.0)

    def latest(self) -> Load | None:
        reading = self._reading
        if reading is None or self.clock() - reading[1] > 2 * self.interval_s:
            return None
        return reading[0]

    def read_once(self) -> Load | None:
        """One read of the metrics route (kept as the latest when it is a reading)."""
        try:
            # A deadline for the whole request: a route that drips its answer is a failure.
            status, body = get(self.url, self.timeout_s, MAX_BYTES)
            if status != 200:
                raise ValueError(f"status {status}")
            load = parse_load(body.decode("utf-8", "replace"), self.rank)
            if load is None:
                raise ValueError(f"no {RUNNING} or {WAITING} in it")
        except (OSError, ValueError) as exc:  # refused, timed out, an error status, junk
            if self.on_error is not None:
                self.on_error()
            if not self._warned:
                logger.warning("engine load: reading %s failed: %s", self.url, exc)
                self._warned = True
            return None
        self._warned = False
        self._reading = (load, self.clock())
        return load

    def _run(self) -> None:
        while not self._stop.is_set():
            began = self.clock()
            self.read_once()
            self._stop.wait(max(self.interval_s - (self.clock() - began), 0.05))
