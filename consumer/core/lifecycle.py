"""The lifecycle rules: what a source's restart or goodbye ends, and when it was last seen.

- Restart: a stream's first message of a newer epoch ends that stream's residencies on the
  media that do not survive a restart, in the same batch ("restart" in the history). The
  source says which media survive in its announcement (``GroupSpec.surviving_media``); the
  announcement that opens the new epoch speaks for it, else the last one heard, else the
  default (STORAGE survives, GPU and CPU do not).
- Goodbye: a clean shutdown ends the source's non-surviving residencies in every group
  ("closed") and marks the source closed until it speaks again.
- Liveness: every message that is not a stale epoch's moves the source's last-seen time
  (its log time) forward; lookups leave out sources silent longer than a window.
"""

from __future__ import annotations

from datetime import UTC, datetime

from kvledger.consumer.core.model import SourceLife, SourceState
from kvledger.consumer.inbound import Inbound
from kvledger.schemas.events import (
    DEFAULT_SURVIVING_MEDIA,
    Envelope,
    Goodbye,
    GroupSpec,
    Heartbeat,
)


def surviving(announced: tuple[str, ...] | None) -> frozenset[str]:
    """The media that outlive a restart, from what the source announced (None: default)."""
    return frozenset(DEFAULT_SURVIVING_MEDIA if announced is None else announced)


def restart_policy(env: Envelope, previous: SourceState) -> tuple[str, ...] | None:
    """What survives the restart ``env`` opens: its own announcement's word, else the last."""
    if isinstance(env.event, GroupSpec):
        return env.event.surviving_media
    return previous.surviving_media


def log_time(message: Inbound, env: Envelope) -> datetime:
    """When the log received the message (its event time when the record has none)."""
    ms = message.timestamp_ms if message.timestamp_ms is not None else env.event_time_ms
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def seen(life: SourceLife | None, env: Envelope, at: datetime) -> SourceLife:
    """The source's life after one more message (never mutates ``life``)."""
    ev = env.event
    heartbeat = ev.interval_ms if isinstance(ev, Heartbeat) else None
    closed = at if isinstance(ev, Goodbye) else None
    if life is None:
        return SourceLife(env.model, env.epoch, at, closed, heartbeat, 0)
    newer = env.epoch > life.epoch
    return SourceLife(
        model=env.model,
        epoch=max(env.epoch, life.epoch),
        last_seen=max(at, life.last_seen),
        closed_at=closed,
        heartbeat_ms=heartbeat if heartbeat is not None else life.heartbeat_ms,
        restarts=life.restarts + (1 if newer else 0),
    )
