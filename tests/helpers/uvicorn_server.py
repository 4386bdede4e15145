"""A real uvicorn server in a thread, on a free loopback port, for tests of HTTP clients
and of the service's own protocols."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serving(app: Any, http: Any = "httptools") -> Iterator[int]:
    """``app`` served by uvicorn with the ``http`` protocol (a name or a protocol class)
    until the block ends; yields the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="warning",
                            access_log=False, proxy_headers=False, lifespan="off")  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)
