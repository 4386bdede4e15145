"""A progress line for long work, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, stream: TextIO = sys.stderr, min_interval: float = 0.2) -> None:
        self.label = label
        self.stream = stream
        self.enabled = stream.isatty()
        self.min_interval = min_interval
        self._last = 0.0
        self._start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < self.min_interval:
            return
        self._last = now
        width = 30
        filled = int(width * done / total) if total else width
        rate = done / max(now - self._start, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"({rate:,.0f}/s)"
        )
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
