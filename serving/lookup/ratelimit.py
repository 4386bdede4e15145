"""Per-client rate limits: a token bucket per client address, the buckets themselves bounded
(the least recently seen client's goes first), so no client can flood a route and no crowd
of clients can grow the limiter."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimit:
    """``rate`` requests a second per client, up to ``burst`` at once; :meth:`allow` says
    whether one more is allowed now, and if not, how many seconds until it is."""

    def __init__(
        self,
        rate: float,
        burst: float,
        max_clients: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1 or max_clients < 1:
            raise ValueError("rate must be positive, burst at least 1, max_clients at least 1")
        self.rate, self.burst, self.max_clients, self.clock = rate, burst, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def allow(self, client: str) -> tuple[bool, float]:
        now = self.clock()
        tokens, at = self._buckets.pop(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens >= 1
        if allowed:
            tokens -= 1
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return allowed, 0.0 if allowed else (1 - tokens) / self.rate

    def __len__(self) -> int:
        return len(self._buckets)
