"""consumer/loop.py: the one loop both the consumer and the router index run. What it does
with each thing a client can give (messages, positions out of the log, fatal errors,
refusals, end-of-partition events), and how a sink ends it."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import Consumer, KafkaError, Message

from kvledger.consumer.inbound import Inbound
from kvledger.consumer.loop import LogLoop, Polled, StopLoop, triage
from kvledger.schemas.errors import NotAuthorizedError


def msg(partition: int, offset: int) -> Message:
    return Message(topic="t", partition=partition, offset=offset, key=b"k", value=b"v%d" % offset)


def err(code: int, partition: int = 0, fatal: bool = False) -> Message:
    return Message(topic="t", partition=partition, error=KafkaError(code, fatal=fatal))


def test_triage_keeps_log_order_and_sorts_the_rest() -> None:
    polled = triage(
        [msg(0, 5), err(KafkaError._PARTITION_EOF), msg(1, 2),
         err(KafkaError._AUTO_OFFSET_RESET, partition=3), msg(0, 6)],
        "t", "a reader",
    )  # fmt: skip
    assert [(m.partition, m.offset) for m in polled.batch] == [(0, 5), (1, 2), (0, 6)]
    assert polled.batch[0].value == b"v5" and polled.reset == {3}
    assert polled.fatal is None and polled.received == 5


def test_triage_leaves_what_is_past_a_bounded_run() -> None:
    polled = triage([msg(0, 4), msg(0, 5), msg(1, 0)], "t", "a reader", stop_at={0: 5})
    assert [(m.partition, m.offset) for m in polled.batch] == [(0, 4)]  # partition 1: 0


def test_triage_says_a_fatal_error_and_raises_a_refusal() -> None:
    polled = triage([msg(0, 1), err(KafkaError._FATAL, fatal=True)], "t", "a reader")
    assert polled.fatal is not None
    with pytest.raises(NotAuthorizedError) as refused:
        triage([err(KafkaError.TOPIC_AUTHORIZATION_FAILED)], "t", "the consumer", needs=" and X")
    assert "the broker refused the consumer" in str(refused.value)
    assert "READ and DESCRIBE on topic 't' and X" in str(refused.value)


class Script:
    """A client owner and a sink that record what the loop asked of them."""

    def __init__(self, turns: list[list[Message]], done_after: int | None = None) -> None:
        self.turns, self.done_after = turns, done_after
        self.calls: list[tuple[str, object]] = []
        self.renewed = 0

    @property
    def client(self) -> Consumer:
        return None  # type: ignore[return-value]  # the script reads, not a client

    def renew(self) -> None:
        self.renewed += 1

    def read(self, _client: Consumer) -> list[Message]:
        return self.turns.pop(0) if self.turns else []

    def apply(self, batch: list[Inbound]) -> None:
        self.calls.append(("apply", [m.offset for m in batch]))

    def lost(self, partitions: set[int]) -> None:
        self.calls.append(("lost", sorted(partitions)))
        if 9 in partitions:
            raise StopLoop

    def turned(self, _client: Consumer, polled: Polled) -> bool:
        self.calls.append(("turned", polled.received))
        turns = sum(1 for c in self.calls if c[0] == "turned")
        return self.done_after is not None and turns >= self.done_after


def run(script: Script, stop: threading.Event | None = None) -> None:
    LogLoop("t", "a reader", script, script.read, script, stop or threading.Event()).run()


def test_the_loop_applies_then_reports_losses_then_turns() -> None:
    script = Script(
        [[msg(0, 1), msg(0, 2)], [err(KafkaError._AUTO_OFFSET_RESET, 4), msg(0, 3)], []],
        done_after=3,
    )
    run(script)
    assert script.calls == [
        ("apply", [1, 2]), ("turned", 2),
        ("apply", [3]), ("lost", [4]), ("turned", 2),
        ("turned", 0),
    ]  # fmt: skip


def test_a_fatal_error_renews_the_client_and_applies_nothing_of_that_read() -> None:
    # The new client starts where the sink stored its offsets: what came with the error
    # is read again, never applied twice.
    script = Script([[msg(0, 1), err(KafkaError._FATAL, fatal=True)], [msg(0, 1)]], done_after=1)
    run(script)
    assert script.renewed == 1
    assert script.calls == [("apply", [1]), ("turned", 1)]


def test_a_sink_or_the_stop_event_ends_the_loop() -> None:
    script = Script([[err(KafkaError._AUTO_OFFSET_RESET, 9)], [msg(0, 1)]])
    run(script)  # the sink's StopLoop
    assert script.calls == [("lost", [9])] and len(script.turns) == 1
    stopped = threading.Event()
    stopped.set()
    script = Script([[msg(0, 1)]])
    run(script, stopped)
    assert script.calls == []


def test_a_router_whose_loop_fails_says_why_in_its_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refusal, or a client that cannot be made again after a fatal error, ends the
    router's tail: its position says why (a stopped router answers /healthz 503)."""
    from kvledger.consumer import loop
    from kvledger.serving.router.index import RouterIndex

    for raised, said in (
        (NotAuthorizedError("the broker refused the router"), "the broker refused the router"),
        (RuntimeError("no broker"), "RuntimeError: no broker"),
    ):
        router = RouterIndex("127.0.0.1:9", "t", "g")  # never started

        def fail(_self: object, exc: Exception = raised) -> None:
            raise exc

        monkeypatch.setattr(loop.LogLoop, "run", fail)
        router._tail()
        assert router.error == said  # what position() reports
