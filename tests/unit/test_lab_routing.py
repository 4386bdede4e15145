"""The lab's streamed completion (bench/lab/routing.py ``complete``): what it reads from an
engine's answer, and which failures leave the request free to go to another engine (nothing
answered: no listener, or the engine gone before its answer began) and which do not (the
answer had begun)."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from bench.lab import routing

Serve = Callable[[socket.socket], None]


def _read_request(conn: socket.socket) -> None:
    """Read one request's head and its body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)


def _reset(conn: socket.socket) -> None:
    """Close with a TCP reset, as a killed process's socket does."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(body: object) -> bytes:
    return _chunk(b"data: " + json.dumps(body).encode() + b"\n\n")


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOKEN = {"choices": [{"text": "a"}]}
USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}},
}
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


@pytest.fixture
def engine() -> Iterator[Callable[[Serve], str]]:
    """A listener that serves one connection as ``serve`` says; yields a function that starts
    it and returns its URL."""
    listeners: list[socket.socket] = []

    def start(serve: Serve) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def run() -> None:
            conn, _ = listener.accept()
            _read_request(conn)
            serve(conn)

        threading.Thread(target=run, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    for listener in listeners:
        listener.close()


def test_an_answer_gives_its_first_token_time_and_the_engines_cached_tokens(engine) -> None:
    def serve(conn: socket.socket) -> None:
        conn.sendall(HEAD + _event(TOKEN) + _event(USAGE) + DONE)
        conn.close()

    out = routing.complete(engine(serve), "a prompt", timeout=5)
    assert out.ok and not out.refused and out.error == ""
    assert 0 < out.ttft <= out.seconds
    assert (out.prompt_tokens, out.cached_tokens) == (40, 32)


def test_no_listener_is_refused() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    out = routing.complete(f"http://127.0.0.1:{port}", "a prompt", timeout=5)
    assert not out.ok and out.refused and out.error == "connection refused"


def test_an_engine_killed_before_it_answers_leaves_the_request_to_go_elsewhere(engine) -> None:
    out = routing.complete(engine(_reset), "a prompt", timeout=5)
    assert not out.ok and out.refused
    assert "ConnectionResetError" in out.error


def test_an_engine_that_closes_without_a_word_leaves_the_request_to_go_elsewhere(engine) -> None:
    out = routing.complete(engine(lambda conn: conn.close()), "a prompt", timeout=5)
    assert not out.ok and out.refused
    assert "RemoteDisconnected" in out.error


def test_an_answer_cut_off_after_it_began_is_a_failure_not_sent_again(engine) -> None:
    def serve(conn: socket.socket) -> None:
        conn.sendall(HEAD + _event(TOKEN))  # a token streamed, then the engine is killed
        _reset(conn)

    out = routing.complete(engine(serve), "a prompt", timeout=5)
    assert not out.ok and not out.refused
    assert out.error


def test_an_error_status_is_a_failure_not_sent_again(engine) -> None:
    def serve(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops")
        conn.close()

    out = routing.complete(engine(serve), "a prompt", timeout=5)
    assert not out.ok and not out.refused
    assert out.error.startswith("HTTP 500")
