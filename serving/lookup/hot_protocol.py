"""uvicorn's httptools protocol, answering the service's hot routes itself: the request is
answered in the HTTP parser's own callbacks and its response written to the connection,
with no ASGI task, scope or receive/send coroutines per request, through the same door
(:class:`~.door.Door`'s gate, handler call, metrics and rendering) as the ASGI path. Every
other request, and any hot one it cannot answer that way (one pipelined behind a response
still being written, ``Expect: 100-continue``, an upgrade, a connection whose writes are
paused), goes to the door as uvicorn's own protocol sends it.

It overrides four of the parser callbacks of uvicorn's ``HttpToolsProtocol``
(constraints.txt pins uvicorn; tests/unit/test_hot_protocol.py runs it in real servers),
under :mod:`.guarded_protocol`'s limits: a hot request is bounded, timed and refused as any
other. A hot route's refusal of a request whose body is large (over ``SMALL_BODY_BYTES``)
is sent at once and the connection closed, its body never read; a small one's body is read
and dropped, so that the client, still sending, reads the answer.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from kvledger.serving.lookup.door import Door, Reply
from kvledger.serving.lookup.guarded_protocol import (
    GuardedProtocol,
    HttpLimits,
    RefusedError,
    guarded,
)
from kvledger.serving.lookup.table import Call, Route

SMALL_BODY_BYTES = 64 * 1024


class _HotProtocol(GuardedProtocol):
    """uvicorn's httptools protocol, answering the hot routes' requests itself (see the
    module docstring). A request is hot from its headers to its end; its body is kept only
    when its route did not refuse it, and a route refuses a body without a Content-Length
    or over its bound, so what is kept is bounded."""

    door: ClassVar[Door | None] = None  # protocol() sets it
    routes: ClassVar[dict[bytes, Route]] = {}  # its hot POST paths -> route

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._route: Route | None = None
        self._refused: Reply | None = None
        self._body: list[bytes] = []
        self._started = 0.0
        self._keep_alive = True

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._route = None

    def on_headers_complete(self) -> None:
        route = self._hot_route()
        if route is None:
            super().on_headers_complete()
            return
        self.head_read()
        self._route, self._started, self._body = route, time.perf_counter(), []
        self._keep_alive = (
            self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        )
        assert self.door is not None
        self._refused = self.door.refusal(route, self.headers, self.client if route.rate else None)
        if self._refused is not None and (self.content_length() or 0) > SMALL_BODY_BYTES:
            self._keep_alive = False
            raise RefusedError(
                self._refused[0], "refused by its route", self._rendered(self._refused)
            )

    def _hot_route(self) -> Route | None:
        """The route of the request whose headers were just read, when this protocol can
        answer it itself (None: uvicorn's own way)."""
        if self.parser.get_method() != b"POST":
            return None
        route = self.routes.get(httptools.parse_url(self.url).path)
        idle = self.cycle is None or self.cycle.response_complete
        if (
            route is None
            or not idle  # a request pipelined behind one being answered: queued in order
            or self.pipeline
            or self.expect_100_continue
            or self.parser.should_upgrade()
            or self.flow.write_paused  # a client not reading: the app's send waits
            or self.limit_concurrency is not None
        ):
            return None
        return route

    def on_body(self, body: bytes) -> None:
        if self._route is None:
            super().on_body(body)
            return
        self.body_read(body)
        if self._refused is None:
            self._body.append(body)

    def on_message_complete(self) -> None:
        route = self._route
        if route is None:
            super().on_message_complete()
            return
        self._route = None
        self.message_read()
        try:
            assert self.door is not None
            reply = self._refused or self.door.answer(
                route, Call(b"".join(self._body), {}, b""), self._started
            )
        except Exception:  # a bug (routes answer their own errors): a 500, as uvicorn's
            self.logger.exception("hot route %s failed", self.url.decode("latin-1"))
            body = b'{"error":"internal error"}'
            reply = (
                500,
                body,
                [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")],
            )
            self._keep_alive = False
        self._body = []
        self.transport.write(self._rendered(reply))
        if not self._keep_alive:
            self.transport.close()
        self.on_response_complete()  # counted; the keep-alive timer armed

    def _rendered(self, reply: Reply) -> bytes:
        status, body, headers = reply
        out = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            out += [name, b": ", value, b"\r\n"]
        if not self._keep_alive:
            out.append(b"connection: close\r\n")
        out += [b"\r\n", body]
        return b"".join(out)


def protocol(door: Door, limits: HttpLimits | None = None) -> type[Any]:
    """uvicorn's ``http`` protocol class for one server, within ``limits`` (default:
    :class:`HttpLimits`'), answering ``door``'s hot routes itself."""
    return guarded(_HotProtocol, limits or HttpLimits(), door=door, routes=dict(door.hot))
