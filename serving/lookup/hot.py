"""The requests a router makes per prompt, answered without the ASGI layers: POST /v1/match
from memory, and Dynamo's POST /query and /query_by_hash.

A lookup from memory takes tens of microseconds; the layers around it cost more: Starlette's
middleware, routing, Request and Response objects, and under them uvicorn's task, scope
dict and receive/send coroutines per request. A :class:`HotRoute` answers synchronously,
from a request's Authorization and Content-Length headers and its body, with the finished
response's status, body and headers. Two ways reach it, with the same answers, bytes and
metrics:

- :class:`HotPath`, an ASGI app in front of the service's Starlette app (any ASGI server,
  and the tests' in-process clients);
- :func:`.hot_protocol.protocol`, the uvicorn protocol ``kvledger serve`` runs, which
  answers a hot route's request in the HTTP parser's own callbacks, with no task per
  request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

Headers = list[tuple[bytes, bytes]]
Reply = tuple[int, bytes, Headers]  # status, JSON body, headers past Content-Length/-Type


class HotRoute:
    """One hot POST path. ``refusal(authorization, content_length)``: the reply to a request
    refused before its body is read (None: read it); ``reply(body, started)``: the reply to
    its body (``started``: ``time.perf_counter()`` when its headers were read, for the
    latency metric). Both record the request's metrics."""

    def __init__(
        self,
        refusal: Callable[[str, str | None], Reply | None],
        reply: Callable[[bytes, float], Reply],
    ) -> None:
        self.refusal, self.reply = refusal, reply

    def refused(self, headers: Iterable[tuple[bytes, bytes]]) -> Reply | None:
        """``refusal`` of a request with these headers (names in lower case)."""
        authorization, length = "", None
        for name, value in headers:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                length = value.decode("latin-1")
        return self.refusal(authorization, length)


def head(body: bytes, headers: Headers) -> Headers:
    """A reply's headers: its length and type, then its own."""
    return [(b"content-length", str(len(body)).encode()),
            (b"content-type", b"application/json"), *headers]  # fmt: skip


class HotPath:
    """The service's app, with its hot routes answered straight on ASGI."""

    def __init__(self, app: ASGIApp, routes: dict[str, HotRoute]) -> None:
        self.app, self.routes = app, routes  # POST path -> its route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.routes.get(scope["path"])
            if route is not None:
                await self._answer(route, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _answer(self, route: HotRoute, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        reply = route.refused(scope["headers"])
        if reply is None:
            raw = await read_body(receive)
            if raw is None:  # the client went away
                return
            reply = route.reply(raw, started)
        status, body, headers = reply
        await send({"type": "http.response.start", "status": status,
                    "headers": head(body, headers)})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive) -> bytes | None:
    """A request's whole body from ASGI messages (None: the client went away)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
