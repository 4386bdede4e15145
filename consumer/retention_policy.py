"""How long the index keeps what (:class:`Retention`), and durations as operators write them
(``90s``, ``10m``, ``7d``). Light: the argument parser and the consumer's config import it."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from datetime import timedelta

from kvledger.schemas.errors import KvledgerError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", re.IGNORECASE)
DURATION_FORM = "a number and a unit: s, m, h, d or w (90s, 10m, 7d)"


class DurationError(KvledgerError, ValueError):
    """A duration (or a retention setting) kvledger cannot use, with what would be right."""


def parse_duration(text: str) -> timedelta:
    """``90s``, ``10m``, ``2h``, ``7d``, ``1w`` as a timedelta; anything else (no unit, zero,
    negative) raises :class:`DurationError`."""
    found = _DURATION.fullmatch(text)
    if found is None:
        raise DurationError(f"{text!r} is not a duration: expected {DURATION_FORM}")
    seconds = float(found.group(1)) * _UNITS[found.group(2).lower()]
    if seconds <= 0:
        raise DurationError(f"{text!r} is not a duration: it must be more than zero")
    return timedelta(seconds=seconds)


def show_duration(d: timedelta) -> str:
    """The shortest exact form of ``d`` in :func:`parse_duration`'s units."""
    seconds = d.total_seconds()
    for unit in ("w", "d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def duration_arg(text: str) -> timedelta:
    """:func:`parse_duration` as an argparse type (its error names the option)."""
    try:
        return parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds_arg(text: str) -> float:
    """A window in seconds as an argparse type: a duration (``90s``, ``5m``) or, as before,
    a plain number of seconds; more than zero and finite."""
    try:
        seconds = float(text)
    except ValueError:
        return duration_arg(text).total_seconds()
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: it must be more than zero")
    return seconds


# The most partitions a retention may keep of each table.
MAX_PARTITIONS = 1000


@dataclass(frozen=True, slots=True)
class Retention:
    """How long each kind of row is kept (the defaults: a week of history and audit, a day
    for a block no one holds)."""

    history: timedelta = timedelta(days=7)
    audit: timedelta = timedelta(days=7)
    blocks: timedelta = timedelta(days=1)

    def check(self, interval: timedelta) -> None:
        """A retention shorter than the partition interval could never drop a partition
        whole on time, and one of more than :data:`MAX_PARTITIONS` intervals would keep that
        many partitions of each table (an as-of lookup probes each): refused, naming the
        option."""
        for option, value in (
            ("--history-retention", self.history),
            ("--audit-retention", self.audit),
        ):
            if value < interval:
                raise DurationError(
                    f"{option} {show_duration(value)} is shorter than the partition interval "
                    f"{show_duration(interval)}: make it at least the interval, or migrate "
                    "with a shorter --partition-interval"
                )
            if value / interval > MAX_PARTITIONS:
                raise DurationError(
                    f"{option} {show_duration(value)} would keep {value // interval:,} "
                    f"partitions of {show_duration(interval)} per table (at most "
                    f"{MAX_PARTITIONS:,}): migrate with a --partition-interval of at least "
                    f"{show_duration(value / MAX_PARTITIONS)}"
                )
