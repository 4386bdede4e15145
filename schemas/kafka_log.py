"""librdkafka's own log lines through Python's logging, each distinct one once.

Left alone, librdkafka writes to stderr itself: past every log handler and format (JSON
logs included), and once per broker per retry, hundreds of lines a minute while a broker
is down. Every Kafka client kvledger opens gets :func:`client_logging`'s settings: its
lines go to the ``kvledger.kafka`` logger, and a line that differs from one already logged
only in its numbers (ports, milliseconds, counts) is counted, not logged again, until
``REPEAT_AFTER_S`` has passed (then once more, with how often it came meanwhile).

Lives with the contract's helpers because both sides open Kafka clients; standard library
only.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

LOGGER = logging.getLogger("kvledger.kafka")
REPEAT_AFTER_S = 600.0
MAX_KINDS = 1024  # distinct lines remembered; past it the oldest is forgotten

_NUMBERS = re.compile(r"\d+")
# Lines librdkafka logs as warnings for what it retries by itself, seen on the happy path (a
# Ctrl-C while an idempotent producer starts): said at INFO, which is what they are.
_RETRIED = ("Failed to acquire idempotence PID",)


class OnceLog:
    """A ``logging.Logger``-like object for librdkafka's ``logger`` setting (it calls
    ``log(level, "%s [%s] %s", facility, client name, text)``)."""

    def __init__(
        self, logger: logging.Logger = LOGGER, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], list[float]] = {}  # kind → [last logged, repeats]

    def log(self, level: int, msg: str, *args: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        if len(args) >= 3:  # librdkafka's call
            facility, name, line = str(args[0]), str(args[1]), str(args[2])
        else:
            facility, name, line = "", "", msg % args if args else msg
        if level == logging.WARNING and line.startswith(_RETRIED):
            level = logging.INFO
        kind = (level, f"{facility} {_NUMBERS.sub('#', line)}")
        now = self.clock()
        with self._lock:
            seen = self._seen.get(kind)
            if seen is not None and now - seen[0] < REPEAT_AFTER_S:
                seen[1] += 1
                return
            repeats = int(seen[1]) if seen is not None else 0
            if seen is None and len(self._seen) >= MAX_KINDS:
                self._seen.pop(next(iter(self._seen)))
            self._seen[kind] = [now, 0]
        more = f" (and {repeats} more like it)" if repeats else ""
        self.logger.log(level, "librdkafka %s %s: %s%s", _client(str(name)), facility, line, more)

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 (the logging.Logger method)
        return self.logger.isEnabledFor(level)


def _client(name: str) -> str:
    """``rdkafka#producer-3`` → ``producer``: the kind of client, not its counter."""
    return _NUMBERS.sub("", name.rpartition("#")[2]).rstrip("-") or name


ONCE = OnceLog()


def client_logging(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with librdkafka's log lines sent to the ``kvledger.kafka`` logger, once
    per distinct line (unless the settings name a ``logger`` of their own)."""
    out = dict(settings)
    out.setdefault("logger", ONCE)
    return out
