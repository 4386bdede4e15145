"""kvledger.client's DecisionReporter against a real `kvledger serve --memory` app in
uvicorn (its index filled through the pipeline, no services): decisions reach the service
without the caller waiting, and a slow, absent or refusing service costs the caller
nothing and is counted."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from kvledger.client import DecisionReporter, LookupClient
from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.serving.lookup.hot_protocol import protocol
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.provisional import Provisional
from tests.helpers.streams import fleet_stream
from tests.helpers.uvicorn_server import serving

FLEET = FleetConfig(instances=3, requests=20, seed=5)


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[str, int]]:
    """The service's URL, served as `kvledger serve --memory` serves it, and its block size."""
    router = RouterIndex("127.0.0.1:9", "t", "g")  # never started: filled here
    messages = fleet_stream(FLEET).messages
    for i in range(0, len(messages), 200):
        run_batch(messages[i : i + 200], Codec(), router.store, "g")
    app = create_app(ServiceConfig(router=router, provisional=Provisional(60.0),
                     silent_after=timedelta(days=9999)))  # fmt: skip
    block = router.block_size(FLEET.model, 0)
    assert block is not None
    with serving(app, protocol(app)) as port:
        yield f"http://127.0.0.1:{port}", block


def prompt(first: int, block: int) -> list[int]:
    """Two full blocks of tokens no engine of the fleet has seen."""
    return list(range(first, first + 2 * block))


def provisional(url: str, tokens: list[int]) -> dict[str, int]:
    with LookupClient(url) as client:
        answer = client.match(FLEET.model, token_ids=tokens)
    return {h.instance: h.matched_blocks for h in answer.holders if h.provisional}


def test_reported_decisions_are_held_by_the_service(service: tuple[str, int]) -> None:
    url, block = service
    prompts = {f"engine-{i}": prompt(700_000 + 1000 * i, block) for i in range(3)}
    with DecisionReporter(url) as reporter:
        for instance, tokens in prompts.items():
            reporter.report(FLEET.model, instance, token_ids=tokens)
        assert reporter.flush(10)
        stats = reporter.stats
    assert (stats.reported, stats.sent, stats.failed, stats.dropped, stats.expired) == (
        3, 3, 0, 0, 0)  # fmt: skip
    for instance, tokens in prompts.items():
        assert provisional(url, tokens) == {instance: 2}


def test_a_refusal_is_counted_with_its_reason_and_the_next_decision_still_goes(
    service: tuple[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    url, block = service
    tokens = prompt(800_000, block)
    with caplog.at_level(logging.WARNING, logger="kvledger.client"), DecisionReporter(url) as r:
        r.report("no-such-model", "engine-0", token_ids=tokens)
        r.report(FLEET.model, "no-such-engine", token_ids=tokens)
        r.report(FLEET.model, "engine-1", token_ids=tokens)
        assert r.flush(10)
        stats = r.stats
    assert (stats.sent, stats.failed) == (1, 2)
    assert stats.last_error is not None and "has sent no events" in stats.last_error
    assert provisional(url, tokens) == {"engine-1": 2}
    warned = [rec.getMessage() for rec in caplog.records]
    assert len(warned) == 1 and "no group 'no-such-model'" in warned[0]  # once per run


def test_close_sends_what_is_queued_and_then_refuses_more(service: tuple[str, int]) -> None:
    url, block = service
    tokens = prompt(900_000, block)
    reporter = DecisionReporter(url)
    reporter.report(FLEET.model, "engine-2", token_ids=tokens)
    reporter.close()
    assert reporter.stats.sent == 1 and provisional(url, tokens) == {"engine-2": 2}
    with pytest.raises(RuntimeError, match="after close"):
        reporter.report(FLEET.model, "engine-2", token_ids=tokens)


def test_a_service_that_never_answers_holds_up_neither_the_caller_nor_the_queue() -> None:
    """A listener that accepts nothing: each send waits out the timeout. The caller's
    reports return at once, the queue keeps only the newest, and what waited too long is
    dropped unsent rather than held by the service from a late arrival."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        reporter = DecisionReporter(url, timeout=0.5, capacity=4, max_age_s=0.2)
        began = time.monotonic()
        for i in range(10):
            reporter.report(FLEET.model, "engine-0", token_ids=[i] * 16)
        took = time.monotonic() - began
        assert took < 0.5, took  # not one send waited for
        assert reporter.flush(10)
        stats = reporter.stats
        reporter.close()
    assert stats.reported == 10 and stats.sent == 0
    assert stats.dropped >= 5  # at most one taken before the queue of 4 filled
    assert stats.failed >= 1 and stats.expired >= 3
    assert stats.dropped + stats.failed + stats.expired == 10
    assert stats.last_error is not None and "no answer from the lookup service" in stats.last_error


def test_a_reporter_needs_room_and_an_age() -> None:
    for bad in ({"capacity": 0}, {"max_age_s": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            DecisionReporter("http://127.0.0.1:9", **bad)  # type: ignore[arg-type]
