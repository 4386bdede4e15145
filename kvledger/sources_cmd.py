"""`kvledger sources`: every source's life as the index follows it."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from kvledger import settings
from kvledger.consumer.admin import SourceStatus, list_sources
from kvledger.consumer.db import connect
from kvledger.consumer.retention import windows
from kvledger.tables import print_table


def run(args: argparse.Namespace) -> int:
    window = timedelta(seconds=args.silent_after) if args.silent_after else None
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        sources = list_sources(conn, window)
        losses = _log_losses(conn)
        retained = windows(conn)
    for topic, partition, first, last, when, ended, whose in losses:
        print(
            f"warning: {topic}[{partition}] lost offsets {first}..{last} before the index read "
            f"them (found {_utc(when)}): {ended} residencies ended "
            f"({', '.join(whose) or 'none held'}) — the topic's retention is shorter than "
            "this consumer was away",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps([asdict(s) for s in sources], default=str, indent=2))
        return 0
    if not sources:
        print("no source has published to this index yet")
        return 0
    print_table(
        (
            "source",
            "model",
            "state",
            "started",
            "last seen",
            "restarts",
            "gaps",
            "GPU",
            "CPU",
            "STORAGE",
            "load",
        ),
        [
            (
                s.source,
                _model(s),
                s.state,
                _started(s.epoch),
                _utc(s.last_seen),
                s.restarts,
                s.gaps,
                s.held["GPU"],
                s.held["CPU"],
                s.held["STORAGE"],
                _load(s),
            )
            for s in sources
        ],
    )
    print("times in UTC; started: the epoch of the source's current process")
    if any(s.load_at is not None for s in sources):
        print(
            "load: requests the engine was running/waiting as its relay last read them "
            "(--engine-metrics-url), shown while the source is live"
        )
    if retained:
        print(
            "retained (older rows dropped by retention): "
            + ", ".join(f"{what} since {_utc(since)}" for what, since in sorted(retained.items()))
        )
    changed = [s for s in sources if s.previous_model is not None]
    for s in changed:
        when = _utc(s.model_changed_at) if s.model_changed_at else "?"
        print(
            f"warning: source {s.source} changed model from {s.previous_model} to {s.model} at "
            f"{when}: give each engine and model its own source id"
        )
    return 0


def _log_losses(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """The newest records the log lost before the index read them (none on a schema from
    before revision 0013, which `kvledger migrate` brings)."""
    try:
        with conn.transaction():
            return conn.execute(
                "SELECT kafka_topic, kafka_partition, first_lost_offset, last_lost_offset, "
                "detected_at, ended_residencies, sources FROM kvledger.log_losses "
                "ORDER BY detected_at DESC LIMIT 20"
            ).fetchall()
    except psycopg.errors.UndefinedTable:
        return []


def _load(s: SourceStatus) -> str:
    if s.load_at is None or s.state not in ("live", "restarted"):
        return "-"
    return f"{_count(s.requests_running)}/{_count(s.requests_waiting)}"


def _count(n: int | None) -> str:
    return "?" if n is None else str(n)


def _model(s: SourceStatus) -> str:
    return s.model if s.previous_model is None else f"{s.model} (was {s.previous_model})"


def _started(epoch_ms: int) -> str:
    """An epoch (ms since 1970 when the process started) as a UTC time; a number before
    1973 as it is (a publisher may number its epochs otherwise)."""
    if not 10**11 <= epoch_ms < 253402300800000:  # 1973 .. 9999
        return str(epoch_ms)
    return _utc(datetime.fromtimestamp(epoch_ms / 1000, UTC))


def _utc(when: datetime) -> str:
    return f"{when.astimezone(UTC):%Y-%m-%d %H:%M:%S}"
