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
- Load: a heartbeat that carries the engine's load (requests running and queued) replaces
  the source's; one without keeps it; a restart, a goodbye or another model ends it (the
  new process, or none, has not said yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TypeGuard

from kvledger.consumer.core.model import ModelChange, SourceLife
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


def restart_policy(env: Envelope, previous: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """What survives the restart ``env`` opens: its own announcement's word, else the last
    one the stream announced (``previous``)."""
    if isinstance(env.event, GroupSpec):
        return env.event.surviving_media
    return previous


def seen(life: SourceLife | None, env: Envelope, at: datetime) -> SourceLife:
    """The source's life after one more message (never mutates ``life``)."""
    ev = env.event
    heartbeat = ev.interval_ms if isinstance(ev, Heartbeat) else None
    closed = at if isinstance(ev, Goodbye) else None
    loaded = isinstance(ev, Heartbeat) and (
        ev.requests_running is not None or ev.requests_waiting is not None
    )
    if life is None:
        life = SourceLife(env.model, env.epoch, at, closed, heartbeat, 0)
        return _with_load(life, ev, at) if loaded else life
    newer = env.epoch > life.epoch
    changed = env.model != life.model
    if loaded:
        load = _with_load(life, ev, at)
    elif newer or changed or closed is not None:
        load = _with_load(life, None, None)
    else:
        load = life
    return SourceLife(
        model=env.model,
        epoch=max(env.epoch, life.epoch),
        last_seen=max(at, life.last_seen),
        closed_at=closed,
        heartbeat_ms=heartbeat if heartbeat is not None else life.heartbeat_ms,
        restarts=life.restarts + (1 if newer else 0),
        previous_model=life.model if changed else life.previous_model,
        model_changed_at=at if changed else life.model_changed_at,
        requests_running=load.requests_running,
        requests_waiting=load.requests_waiting,
        load_at=load.load_at,
    )


def _with_load(life: SourceLife, ev: object, at: datetime | None) -> SourceLife:
    """``life`` with the load ``ev`` carries (a heartbeat's), or none (``ev`` None)."""
    if isinstance(ev, Heartbeat):
        return replace(
            life,
            requests_running=ev.requests_running,
            requests_waiting=ev.requests_waiting,
            load_at=at,
        )
    return replace(life, requests_running=None, requests_waiting=None, load_at=None)


class Lives:
    """The sources' lives through one batch: :func:`seen` for every message that changes
    more than the last-seen time, and the newest log time per source (cheap per message)."""

    def __init__(self, snapshot: Mapping[str, SourceLife]) -> None:
        self.snap = snapshot
        self.changed: dict[str, SourceLife] = {}
        self.last_ms: dict[str, int] = {}
        self.model_changes: list[ModelChange] = []

    def observe(self, message: Inbound, env: Envelope) -> None:
        ms = message.timestamp_ms if message.timestamp_ms is not None else env.event_time_ms
        source = env.source
        if self.last_ms.get(source, -1) < ms:
            self.last_ms[source] = ms
        life = self.changed.get(source) or self.snap.get(source)
        if leaves_life(life, env):
            if source not in self.changed:
                self.changed[source] = life
            return
        self.changed[source] = seen(life, env, utc(ms))
        if life is not None and env.model != life.model:
            self.model_changes.append(ModelChange(source, life.model, env.model, utc(ms)))

    def result(self) -> dict[str, SourceLife]:
        out = {}
        for source, life in self.changed.items():
            last = utc(self.last_ms[source])
            out[source] = replace(life, last_seen=last) if last > life.last_seen else life
        return out


def leaves_life(life: SourceLife | None, env: Envelope) -> TypeGuard[SourceLife]:
    """Whether a message leaves its source's life as it is, but for when it was last seen:
    a known source, not closed, of the same model, no newer epoch, and neither a heartbeat
    nor a goodbye (the router's fast lane takes only such messages)."""
    return (
        life is not None
        and env.epoch <= life.epoch
        and life.closed_at is None
        and env.model == life.model
        and not isinstance(env.event, Heartbeat | Goodbye)
    )


UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def utc(ms: int) -> datetime:
    """A time in ms since the Unix epoch as an aware UTC datetime, exactly (through a float
    of seconds, a time after 2033 could come back a µs off)."""
    return UNIX_EPOCH + timedelta(milliseconds=ms)
