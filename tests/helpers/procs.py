"""Child processes started by tests (so that a failing test cannot leave one running), and
free loopback ports for the services some tests start themselves."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

_children: list[subprocess.Popen[Any]] = []


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    proc: subprocess.Popen[Any] = subprocess.Popen(args, **kwargs)
    _children.append(proc)
    return proc


def reap() -> None:
    """Kill every child still running (called after each test)."""
    while _children:
        proc = _children.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


# Below the kernel's ephemeral range (32768-60999 on Linux): a port the kernel hands to an
# outgoing connection (a Kafka client's, say) between the test's choice and its bind would
# otherwise be taken, as CI once saw.
_LOW, _HIGH = 20_000, 32_000
_rng = random.Random()
# Every port handed out in this process: a test that takes several ports one at a time
# binds none of them before asking for the next, so "free now" alone could hand out one
# twice (a Kafka port equal to its controller's, once seen in CI).
_given: set[int] = set()


def free_ports(count: int) -> int:
    """The first of ``count`` adjacent loopback ports that are free now and were never handed
    out before in this process (vLLM offsets a data parallel rank's ports by the rank)."""
    for _ in range(1000):
        base = _rng.randrange(_LOW, _HIGH - count)
        if _given.intersection(range(base, base + count)):
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            _given.update(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} adjacent free ports in {_LOW}-{_HIGH}")


def free_port() -> int:
    return free_ports(1)


def first_answer(url: str, what: str, timeout: float = 30, **httpx_args: Any) -> Any:
    """The first HTTP answer of ``url`` (any status) from a service that is starting: it
    is asked again every 0.3 s while nothing listens; fails the test after ``timeout``."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, **httpx_args)
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"{what} never answered"
            time.sleep(0.3)


def require_dynamo() -> None:
    """Skip the calling test module where Dynamo's released indexer (ai-dynamo-runtime, the
    dev extra) is not installed, except under CI, where its absence must fail the tests."""
    import os

    import pytest

    if os.environ.get("CI") != "true":
        pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the dev extra)")


def until(what: str, check: Callable[[], Any], timeout: float = 20) -> Any:
    """The first true answer of ``check()``, asked every 20 ms; fails the test, saying
    ``what``, when none came within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return got
