"""Child processes started by tests (so that a failing test cannot leave one running), and
free loopback ports for the services some tests start themselves."""

from __future__ import annotations

import socket
import subprocess
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
