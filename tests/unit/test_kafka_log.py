"""librdkafka's log lines through logging, once per distinct line (schemas.kafka_log)."""

from __future__ import annotations

import logging

import pytest

from kvledger.schemas.kafka_log import REPEAT_AFTER_S, OnceLog, client_logging


def test_each_distinct_line_is_logged_once_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = OnceLog(logging.getLogger("kvledger.kafka.test"), clock=lambda: now[0])
    fail = "127.0.0.1:{}/bootstrap: Connect to ipv4#127.0.0.1:{} failed: Connection refused"
    with caplog.at_level(logging.INFO, logger="kvledger.kafka.test"):
        for attempt in range(300):  # what a minute of a broker down gave before
            line = fail.format(19092, 19092) + f" (after {attempt}ms in state CONNECT)"
            log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", line)
        log.log(logging.WARNING, "%s [%s] %s", "REQTMOUT", "rdkafka#consumer-2", "Timed out")
        assert len(caplog.records) == 2
        first = caplog.records[0]
        assert first.levelno == logging.ERROR
        assert first.getMessage().startswith("librdkafka producer FAIL: 127.0.0.1:19092/")
        now[0] += REPEAT_AFTER_S + 1  # later, once more, with how often it came meanwhile
        line = fail.format(1, 1) + " (after 0ms in state CONNECT)"
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", line)
        assert caplog.records[-1].getMessage().endswith("(and 299 more like it)")


def test_clients_get_the_logger_unless_they_name_one() -> None:
    settings = client_logging({"bootstrap.servers": "b:1"})
    assert isinstance(settings["logger"], OnceLog) and settings["bootstrap.servers"] == "b:1"
    mine = logging.getLogger("mine")
    assert client_logging({"logger": mine})["logger"] is mine


def test_a_line_for_what_the_client_retries_itself_is_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C on `consume` logged librdkafka's "Failed to acquire idempotence PID ...
    retrying" as a WARNING on the happy path: it is said at INFO; other warnings stay."""
    log = OnceLog(logging.getLogger("kvledger.kafka.calm"))
    with caplog.at_level(logging.INFO, logger="kvledger.kafka.calm"):
        log.log(logging.WARNING, "%s [%s] %s", "GETPID", "rdkafka#producer-3",
                "Failed to acquire idempotence PID from broker TxnCoordinator/1: "
                "Broker: Coordinator load in progress: retrying")  # fmt: skip
        log.log(logging.WARNING, "%s [%s] %s", "REQTMOUT", "rdkafka#producer-3", "Timed out")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
