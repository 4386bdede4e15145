"""Retention settings as operators write them: durations, and the checks against the
partition interval (no services)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kvledger.consumer.retention_policy import (
    MAX_PARTITIONS,
    DurationError,
    Retention,
    parse_duration,
    show_duration,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("10m", 600), ("2h", 7200), ("7d", 604800), ("1w", 604800), (" 1.5S ", 1.5)],
)
def test_a_duration_is_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["10", "", "d", "-5m", "0s", "0d", "7 days", "1e3s", "5ms"])
def test_anything_else_is_refused_with_the_form(text: str) -> None:
    with pytest.raises(DurationError, match="is not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["90s", "10m", "2h", "6d", "2w", "1.5s"])
def test_a_duration_shows_as_it_was_written(text: str) -> None:
    assert show_duration(parse_duration(text)) == text


def test_the_defaults_are_a_week_a_week_and_a_day() -> None:
    assert Retention() == Retention(timedelta(days=7), timedelta(days=7), timedelta(days=1))
    Retention().check(timedelta(days=1))  # the defaults fit the default interval


def test_a_retention_shorter_than_the_interval_names_its_option() -> None:
    with pytest.raises(DurationError, match="--audit-retention 30s is shorter than the"):
        Retention(timedelta(minutes=10), timedelta(seconds=30)).check(timedelta(minutes=1))
    with pytest.raises(DurationError, match="--history-retention 1h is shorter than the"):
        Retention(history=timedelta(hours=1)).check(timedelta(days=1))


def test_a_retention_of_too_many_partitions_says_which_interval_would_do() -> None:
    week = Retention()
    with pytest.raises(DurationError, match=r"would keep 20,160 partitions of 30s .* 604.8s"):
        week.check(timedelta(seconds=30))
    week.check(timedelta(days=7) / MAX_PARTITIONS)
