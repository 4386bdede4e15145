"""The lab's JSON calls to the services its routers ask (bench/lab/stack.py): one keep-alive
connection per thread and service, a connection the service closed while idle replaced
once, and every failure an OSError (what the routers catch to route without an answer)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.lab import stack


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    connections: set[tuple[str, int]] = set()  # the client addresses it served

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, body: object) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self.connections.add(self.client_address)
        if self.path == "/broken":
            self._answer(503, {"error": "starting"})
        elif self.path == "/close":  # answers, then closes the connection it kept open
            self._answer(200, {"closing": True})
            self.close_connection = True
        else:
            self._answer(200, {"path": self.path})

    def do_POST(self) -> None:
        self.connections.add(self.client_address)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(200, {"echo": json.loads(body)})


@pytest.fixture
def service() -> Iterator[str]:
    _Handler.connections = set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_calls_on_one_thread_share_one_connection(service: str) -> None:
    assert stack.post_json(f"{service}/v1/match", {"a": 1}) == {"echo": {"a": 1}}
    assert stack.get_json(f"{service}/workers?x=1") == {"path": "/workers?x=1"}
    assert stack.post_json(f"{service}/v1/decisions", {"b": 2}) == {"echo": {"b": 2}}
    assert len(_Handler.connections) == 1


def test_each_thread_has_its_own_connection(service: str) -> None:
    stack.get_json(f"{service}/a")
    other = threading.Thread(target=stack.get_json, args=(f"{service}/b",))
    other.start()
    other.join()
    assert len(_Handler.connections) == 2


def test_a_connection_the_service_closed_is_replaced_once(service: str) -> None:
    assert stack.get_json(f"{service}/close") == {"closing": True}
    assert stack.get_json(f"{service}/after") == {"path": "/after"}
    assert len(_Handler.connections) == 2


def test_an_error_status_or_no_service_is_an_oserror(service: str) -> None:
    with pytest.raises(OSError, match="HTTP 503"):
        stack.get_json(f"{service}/broken")
    assert stack.get_json(f"{service}/fine") == {"path": "/fine"}  # the connection still serves
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(OSError):
        stack.get_json(f"http://127.0.0.1:{port}/x", 1.0)
