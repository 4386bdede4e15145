"""`kvledger serve`'s HTTP limits (serving/lookup/guarded_protocol.py) in real uvicorn
servers on loopback sockets, each reproducing an attack that once worked: headers and
targets that grow without bound, bodies read whole before being refused, connections that
never finish a request, a body smuggled past an upgrade, and more connections than the
server has descriptors. After each, an honest request on a new connection is answered."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import Any

import pytest

from kvledger.serving.lookup.door import Door
from kvledger.serving.lookup.guarded_protocol import GuardedProtocol, HttpLimits, guarded
from tests.unit.test_hot_protocol import (
    BEARER,
    exchange,
    make_app,
    post,
    read_responses,
    requests,
    server,
)


@pytest.fixture(scope="module")
def app() -> Door:
    return make_app()


FAST = HttpLimits(head_timeout_s=0.5, body_timeout_s=0.5, max_connections=32)


def answered(port: int) -> int:
    """An honest hot request's status on a new connection."""
    return exchange(port, requests()[1], 1)[0][0]


def refusal(sock: socket.socket) -> tuple[int, str, bool]:
    """The refusal read from ``sock``: its status, its reason, and whether the server then
    closed the connection."""
    status, headers, body = read_responses(sock, 1)[0]
    sock.settimeout(5)
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:
        closed = True
    return status, json.loads(body)["error"], closed and headers.get("connection") == "close"


def test_a_head_that_never_ends_is_refused_at_its_bound(app: Door) -> None:
    with server(app, hot=True) as port:
        for path in ("/query", "/openapi.json"):  # a hot route and the app's
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nx-big: ")
                sent = 0
                try:
                    while sent < 64 << 20:  # a 64 MiB header value, unless cut off first
                        sock.sendall(b"a" * 65536)
                        sent += 65536
                except (BrokenPipeError, ConnectionResetError):
                    pass
                assert sent < 4 << 20, sent  # refused at 16 KiB, not read to the end
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /openapi.json HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 20_000)
            assert refusal(sock)[:2] == (431, "a request head over 16384 bytes")
        many = b"".join(b"x-%d: 1\r\n" % i for i in range(101))
        assert exchange(port, post("/query", b"{}", many), 1)[0][0] == 431
        long_url = b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nhost: t\r\n\r\n"
        assert exchange(port, long_url, 1)[0][0] == 414
        assert answered(port) == 200


def test_a_body_over_the_bound_is_refused_before_it_is_read(app: Door) -> None:
    with server(app, hot=True) as port:
        for path, bound in (("/register", 8 << 20), ("/v1/match", 1 << 20), ("/query", 8 << 20)):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                head = post(path, b"", BEARER).replace(
                    b"content-length: 0", b"content-length: %d" % (bound + 1)
                )
                sock.sendall(head)  # no body sent: the answer must not wait for one
                status, _, closed = refusal(sock)
                assert status in (400, 413) and closed, (path, status)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                post("/register", b"", BEARER, length=False).split(b"\r\n\r\n")[0] + b"\r\n\r\n"
            )
            sent = 0
            try:
                while sent < 64 << 20:
                    sock.sendall(b"10000\r\n" + b"a" * 65536 + b"\r\n")  # chunked, no length
                    sent += 65536
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert sent < 16 << 20, sent
        assert answered(port) == 200


def test_a_request_that_does_not_arrive_in_time_is_refused(app: Door) -> None:
    with server(app, hot=True, limits=FAST) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /query HTTP/1.1\r\nhost: t\r\n")  # then nothing
            started = time.monotonic()
            assert refusal(sock) == (408, "a request head not received within 0.5 s", True)
            assert time.monotonic() - started < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                post("/query", b'{"token_ids": [1', BEARER).replace(
                    b"content-length: 16", b"content-length: 40"
                )
            )  # the body stops short
            assert refusal(sock)[:2] == (408, "a request body not received within 0.5 s")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # silent: closed without a word
        assert answered(port) == 200


def test_no_body_is_smuggled_past_an_upgrade(app: Door) -> None:
    """A POST asking to upgrade had its body ignored and, arriving in a later packet, read
    as a second request: a hidden GET /workers was answered."""
    hidden = b"GET /workers HTTP/1.1\r\nhost: t\r\n\r\n"
    with server(app, hot=True) as port:
        for path in ("/query", "/register", "/openapi.json"):
            smuggler = post(path, hidden, BEARER, b"connection: Upgrade\r\n", b"upgrade: h2c\r\n")
            head, _, body = smuggler.partition(b"\r\n\r\n")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(head + b"\r\n\r\n")
                time.sleep(0.2)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(body)
                assert refusal(sock) == (400, "protocol upgrades are not served", True)
        assert answered(port) == 200


def test_more_connections_than_the_bound_close_the_longest_waiting(app: Door) -> None:
    limits = HttpLimits(max_connections=32)
    with server(app, hot=True, limits=limits) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                for _ in range(20):  # an honest client's kept-alive connection meanwhile
                    sock.sendall(requests()[1])
                    assert read_responses(sock, 1)[0][0] == 200
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            closed = 0
            for s in idle[:60]:  # the oldest were closed to make room
                s.settimeout(2)
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    closed += s.recv(1) == b""
            assert closed >= 50, closed
        finally:
            for s in idle:
                s.close()
        assert answered(port) == 200


def test_the_app_sees_the_scope_uvicorns_own_protocol_gives() -> None:
    """The guarded protocol builds a request's scope itself (its addresses read only once
    the head is in): the app must see what uvicorn's own protocol gives it, addresses
    included."""
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append({k: v for k, v in scope.items() if k != "state"})
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    clients = []
    for http in ("httptools", guarded(GuardedProtocol, HttpLimits())):
        with (
            server(app, hot=False, http=http) as port,
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
        ):
            for _ in range(2):  # a second request on the same connection, too
                sock.sendall(b"GET /a/b?c=1 HTTP/1.1\r\nhost: t\r\nx-k: v\r\n\r\n")
                assert read_responses(sock, 1)[0][0] == 204
            clients.append(sock.getsockname())
    assert len(seen) == 4
    own, *_, guarded_seen = seen
    assert own["client"] == clients[0] and guarded_seen["client"] == clients[1]
    assert own["server"][0] == guarded_seen["server"][0] == "127.0.0.1"
    for scope in (own, guarded_seen):
        del scope["client"]  # the ports differ from run to run
        scope["server"] = scope["server"][0]
    assert guarded_seen == own
