"""The dashboard (``GET /ui``, read-only): one page (ui/index.html, with the vendored Chart.js
that scripts/vendor-ui puts in ui/vendor/) that asks ``GET /v1/dashboard`` for the fleet
at a glance and draws it, refreshing every few seconds.

The page itself holds no data and needs no token; ``/v1/dashboard`` sits behind the same
bearer token as every other route (the page asks for it once and keeps it for the tab).
Every name it shows (an engine, a model) is set as text, never as markup.

``/v1/dashboard?minutes=N`` (1..1440, 60 by default) answers, from the database:

- ``fleet``: each source now (kvledger.source_status): its state, epoch, last event, restarts,
  gaps, losses and blocks held per tier;
- ``occupancy``: per minute of the window, the blocks each instance held on each tier at the
  minute's end (from residency history);
- ``funnel``: per minute, the decisions recorded and their available, captured and
  delivered blocks, and the count of each outcome (kvledger.decision_funnel);
- ``prefixes``: the ten prefixes held by the most instances (kvledger.hottest_prefixes);
- ``timeline``: restarts, closings and lost log ranges in the window.

From memory (``serve --memory``) only ``fleet`` is answered (the rest is the database's).

An answer is computed for one of a few windows (:data:`WINDOWS`, the smallest that holds
the one asked), at most once every :data:`SHARED_FOR_S` (the page's refresh), whatever the
number of viewers (:class:`SharedAnswers`), and each viewer gets it cut to its own window
(:func:`cut`): however many windows are asked, at most ``len(WINDOWS)`` computations run at
once, and a viewer who asks while its window is computed again gets the answer before it.
From the database it is read from the history the consumer writes meanwhile; from memory
it walks every holder's blocks under the lookups' lock.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvledger.serving.lookup.requests import BadRequestError

if TYPE_CHECKING:
    import psycopg

    from kvledger.serving.router.index import RouterIndex

UI = Path(__file__).resolve().parent / "ui"
VENDOR = UI / "vendor"
MAX_MINUTES = 1440
# The windows answers are computed for: a window asked is cut from the smallest that holds it.
WINDOWS = (15, 60, 360, MAX_MINUTES)
SHARED_FOR_S = 5.0  # the page refreshes every 5 s (ui/dashboard.js REFRESH_MS)
OUTCOMES = (
    "no_holder",
    "holder_silent",
    "chosen_elsewhere",
    "lower_tier_only",
    "evicted_before_arrival",
    "captured",
    "unreported",
)

_FLEET = """
SELECT source, model, state, epoch, last_seen, restarts, gaps, lost_gaps, lost_batches,
       held_gpu, held_cpu, held_storage
FROM kvledger.source_status ORDER BY source, model
"""
# Occupancy, walked back from now: what is held now, less the stores and plus the
# removals after each minute's end (one grouped pass over the window's history, where a
# join of every minute with history would be one pass per minute). What is held now: the
# live residencies (the history's open intervals, one each, read from the small table).
_HELD_NOW = """
SELECT instance, medium, count(*) FROM kvledger.residencies GROUP BY 1, 2
"""
# The window's stores and removals in one pass: per holder, the minute each interval was
# stored in and the minute it was removed in (NULL: outside the window), counted. (The
# open partition, every live interval, is read once, not once for each: 0.19 s against
# 0.30 s on a million-block index, bench.dashboard's.)
_MOVES = """
SELECT instance, medium,
       CASE WHEN stored_at >= %(since)s THEN date_trunc('minute', stored_at) END,
       CASE WHEN removed_at >= %(since)s THEN date_trunc('minute', removed_at) END,
       count(*)
FROM kvledger.residency_history
WHERE coalesce(closed_at, 'infinity'::timestamptz) >= %(since)s
  AND (stored_at >= %(since)s OR removed_at >= %(since)s)
GROUP BY 1, 2, 3, 4
"""
_FUNNEL = f"""
SELECT minute, sum(decisions), sum(prompt_blocks), sum(available_blocks),
       sum(captured_blocks), sum(delivered_blocks), sum(delivered_known),
       {", ".join(f"sum({o})" for o in OUTCOMES)}
FROM kvledger.decision_funnel WHERE minute >= date_trunc('minute', %(since)s::timestamptz)
  AND minute <= %(until)s
GROUP BY minute ORDER BY minute
"""
_PREFIXES = """
SELECT model, group_idx, encode(block_hash, 'hex'), token_start, token_end, instances,
       residencies
FROM kvledger.hottest_prefixes ORDER BY instances DESC, token_end DESC NULLS LAST LIMIT 10
"""
_TIMELINE = """
SELECT event_time, source, kind FROM kvledger.lifecycle_events WHERE event_time >= %(since)s
UNION ALL
SELECT detected_at, kafka_topic || '/' || kafka_partition, 'log_loss'
FROM kvledger.log_losses WHERE detected_at >= %(since)s
ORDER BY 1 LIMIT 500
"""


def minutes_of(params: dict[str, str]) -> int:
    """The window asked for (``minutes``: 1..1440, 60 when absent); 400 otherwise."""
    raw = params.get("minutes", "60")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_MINUTES:
        raise BadRequestError(f"minutes: a whole number from 1 to {MAX_MINUTES}, not {raw!r}")
    return int(raw)


def window_of(minutes: int) -> int:
    """The window an answer for ``minutes`` is cut from."""
    return next(w for w in WINDOWS if w >= minutes)


def cut(answer: dict[str, Any], minutes: int) -> dict[str, Any]:
    """``answer`` (computed for a window at least ``minutes`` long) for the last ``minutes``
    before its ``now``: its series from then on."""
    now = datetime.fromisoformat(answer["now"])
    since = now - timedelta(minutes=minutes)
    first = since.replace(second=0, microsecond=0)

    def after(at: datetime) -> list[dict[str, Any]]:
        return [p for p in answer[key] if datetime.fromisoformat(p["t"]) >= at]

    out = {**answer, "minutes": minutes}
    for key, at in (
        ("occupancy", first + timedelta(minutes=1)),
        ("funnel", first),
        ("timeline", since),
    ):
        out[key] = after(at)
    return out


def from_database(conn: psycopg.Connection, minutes: int) -> dict[str, Any]:
    """The answer from the index, read in one read-only transaction (one view of it) without
    PostgreSQL's JIT, whose compiling the views' estimates set off cost more than the
    queries themselves (the funnel: 31 ms with it, 8 ms without, measured)."""
    with conn.transaction():
        conn.execute("SET TRANSACTION READ ONLY")
        conn.execute("SET LOCAL jit = off")
        return _read(conn, minutes)


def _read(conn: psycopg.Connection, minutes: int) -> dict[str, Any]:
    until = datetime.now(UTC)
    window = {"since": until - timedelta(minutes=minutes), "until": until}
    fleet = [
        {
            "source": s,
            "model": m,
            "state": st,
            "epoch": e,
            "last_seen": _iso(seen),
            "restarts": r,
            "gaps": g,
            "lost_gaps": lg,
            "lost_batches": lb,
            "held": {"GPU": gpu, "CPU": cpu, "STORAGE": sto},
        }
        for s, m, st, e, seen, r, g, lg, lb, gpu, cpu, sto in conn.execute(_FLEET).fetchall()
    ]
    occupancy = _occupancy(conn, window["since"], until)
    funnel = []
    for row in conn.execute(_FUNNEL, window).fetchall():
        minute, decisions, prompt, available, captured, delivered, known, *outcomes = row
        funnel.append(
            {
                "t": _iso(minute),
                "decisions": int(decisions),
                "prompt_blocks": int(prompt),
                "available_blocks": int(available),
                "captured_blocks": int(captured),
                "delivered_blocks": int(delivered or 0),
                "delivered_known": int(known),
                "outcomes": {o: int(n) for o, n in zip(OUTCOMES, outcomes, strict=True)},
            }
        )
    prefixes = [
        {
            "model": m,
            "group_idx": g,
            "block_hash": h,
            "token_start": s,
            "token_end": e,
            "instances": n,
            "residencies": r,
        }
        for m, g, h, s, e, n, r in conn.execute(_PREFIXES).fetchall()
    ]
    timeline = [
        {"t": _iso(t), "what": what, "kind": kind}
        for t, what, kind in conn.execute(_TIMELINE, window).fetchall()
    ]
    return {
        "mode": "sql",
        "minutes": minutes,
        "now": _iso(until),
        "fleet": fleet,
        "occupancy": occupancy,
        "funnel": funnel,
        "prefixes": prefixes,
        "timeline": timeline,
    }


def _occupancy(conn: psycopg.Connection, since: datetime, until: datetime) -> list[dict[str, Any]]:
    """Blocks each instance held on each tier at the end of every minute from ``since``'s
    to ``until``'s (a minute's stores and removals count at its end)."""
    held = {(i, m): int(n) for i, m, n in conn.execute(_HELD_NOW).fetchall()}
    # Per holder and minute start: the stores and removals in that minute.
    moves: dict[tuple[str, str], dict[datetime, int]] = {}
    for instance, medium, stored, removed, n in conn.execute(_MOVES, {"since": since}):
        by_minute = moves.setdefault((instance, medium), {})
        if stored is not None:
            by_minute[stored] = by_minute.get(stored, 0) + int(n)
        if removed is not None:
            by_minute[removed] = by_minute.get(removed, 0) - int(n)
    first = since.replace(second=0, microsecond=0)
    minutes = int((until - first).total_seconds() // 60) + 1
    ends = [first + timedelta(minutes=k + 1) for k in range(minutes)]
    out = []
    for key in sorted(set(held) | set(moves)):
        count, by_minute = held.get(key, 0), moves.get(key, {})
        series = []
        for end in reversed(ends):  # from now back: undo each minute's moves
            series.append(count)
            count -= by_minute.get(end - timedelta(minutes=1), 0)
        for end, n in zip(ends, reversed(series), strict=True):
            if n:
                out.append({"t": _iso(end), "instance": key[0], "medium": key[1], "blocks": n})
    out.sort(key=lambda o: (o["t"], o["instance"], o["medium"]))
    return out


def from_memory(
    router: RouterIndex, minutes: int, silent_after: timedelta | None
) -> dict[str, Any]:
    """The fleet now from the router's index; the history series are the database's."""
    fleet = []
    for (source, model), held in sorted(router.footprint().items()):
        state = router.states([source], silent_after)[source]
        fleet.append({"source": source, "model": model, "state": state, "held": held})
    return {
        "mode": "memory",
        "minutes": minutes,
        "now": _iso(datetime.now(UTC)),
        "fleet": fleet,
        "occupancy": [],
        "funnel": [],
        "prefixes": [],
        "timeline": [],
    }


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).isoformat()


T = TypeVar("T")


def encoded(answer: dict[str, Any]) -> bytes:
    """An answer as the JSON bytes sent, encoded once and shared with its viewers (as
    Starlette's JSONResponse encodes: compact, UTF-8)."""
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class SharedAnswers(Generic[T]):
    """Answers per window shared by every viewer for ``ttl_s``: computed once meanwhile; a
    viewer that asks while one is being computed gets the answer before it, or, when
    there is none yet, waits for it rather than computing it again. At most ``keep``
    windows are kept (the least recently asked go). A computation that fails is not
    kept. The service keeps each computed window's answer: a viewer then costs a cut
    and an encoding, never a computation."""

    def __init__(
        self,
        ttl_s: float = SHARED_FOR_S,
        keep: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.keep, self.clock = ttl_s, keep, clock
        self.computed = 0  # answers computed (the rest were shared)
        self._lock = threading.Lock()
        self._answers: OrderedDict[int, tuple[float, T]] = OrderedDict()
        self._computing: dict[int, threading.Lock] = {}

    def _fresh(self, minutes: int) -> T | None:
        hit = self._answers.get(minutes)
        if hit is None or self.clock() - hit[0] >= self.ttl_s:
            return None
        self._answers.move_to_end(minutes)
        return hit[1]

    def get(self, minutes: int, compute: Callable[[], T]) -> T:
        with self._lock:
            if (answer := self._fresh(minutes)) is not None:
                return answer
            gate = self._computing.setdefault(minutes, threading.Lock())
            stale = self._answers.get(minutes)
        if stale is not None and gate.locked():  # being computed again: the one before it
            return stale[1]
        with gate:  # one computation per window at a time
            with self._lock:
                if (answer := self._fresh(minutes)) is not None:
                    return answer  # computed while this viewer waited
            answer = compute()
            with self._lock:
                self.computed += 1
                self._answers[minutes] = (self.clock(), answer)
                self._answers.move_to_end(minutes)
                while len(self._answers) > self.keep:
                    self._answers.popitem(last=False)
                if self._computing.get(minutes) is gate:
                    del self._computing[minutes]
            return answer
