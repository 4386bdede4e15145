"""The lookup service's one door: every request, from the socket to its handler, goes
through :class:`Door`, whatever reaches it.

Two transports reach the door, with the same answers, bytes and metrics:

- ASGI (:meth:`Door.__call__`): uvicorn's own protocol, any ASGI server, the tests'
  in-process clients;
- the HTTP parser's callbacks (:mod:`.hot_protocol`, the protocol ``kvledger serve``
  runs), for the hot routes (POST /v1/match from memory, Dynamo's /query and
  /query_by_hash): a lookup from memory takes tens of microseconds, and an ASGI task,
  scope and receive/send coroutines per request cost more. It calls the same
  :meth:`Door.refusal` and :meth:`Door.answer`.

Each request meets one gate (:class:`Gate`, :meth:`Door.refusal`): its route's token
(401), its rate (429) and its body's Content-Length and bound (400, or Dynamo's 411/413),
in that order, all read from the route's table entry; then its handler, whose errors are
answered in one place (:func:`.routes.error_answer`); then one count in the request
metrics and one rendering.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from prometheus_client import Counter
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from kvledger.serving.lookup.metrics import LATENCY, REQUESTS
from kvledger.serving.lookup.ratelimit import RateLimit
from kvledger.serving.lookup.routes import error_answer
from kvledger.serving.lookup.table import Answer, Call, Raw, Role, Route, Table

Headers = list[tuple[bytes, bytes]]
Reply = tuple[int, bytes, Headers]  # status, body, headers (Content-Length and -Type first)

REFUSED = {"error": "a bearer token is required"}


class Gate:
    """What every route is checked against before its body is read: the token of its role
    (``tokens``: role -> token, None: none needed), its rate class (``rates``: class ->
    per-client limit, and what it counts) and its body's bound."""

    def __init__(
        self,
        tokens: Mapping[Role, str | None],
        rates: Mapping[str, tuple[RateLimit, str]],
    ) -> None:
        self.expected = {
            role: f"Bearer {token}".encode() if token else None for role, token in tokens.items()
        }
        self.rates = rates

    def refusal(
        self, route: Route, headers: Iterable[tuple[bytes, bytes]], client: Any
    ) -> Answer | None:
        """The answer refusing a request for ``route`` with these ``headers`` (names in
        lower case) from ``client`` (the ASGI ``(host, port)``, read for a rate only);
        None: it may go on."""
        authorization, length = b"", None
        for name, value in headers:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                length = value.decode("latin-1")
        if route.role != "open":
            expected = self.expected.get(route.role)
            if expected is not None and not hmac.compare_digest(authorization, expected):
                return 401, REFUSED, {"WWW-Authenticate": "Bearer"}
        if route.rate is not None:
            limit, what = self.rates[route.rate]
            ok, wait = limit.allow(client[0] if client else "")
            if not ok:
                error = f"over {limit.rate:g} {what} a second from this client"
                return 429, {"error": error}, {"Retry-After": str(max(1, math.ceil(wait)))}
        body = route.body
        if body is not None:
            if length is None or not (length.isascii() and length.isdigit()):
                return body.missing, {"error": "a JSON body with Content-Length is required"}, {}
            if int(length) > body.max_bytes:
                return body.over, {"error": f"body over {body.max_bytes} bytes"}, {}
        return None


class Door:
    """The service as an ASGI app over its route ``table``: every request found in the
    table (404, 405 otherwise), checked by ``gate``, answered by its handler with
    ``parts`` (:class:`~.http.Parts`), counted and rendered here. ``in_memory``: the
    lookups are answered from memory (on the event loop, and the hot routes in the
    parser's callbacks). ``lifespan``: what opens and closes with the server."""

    def __init__(
        self,
        table: Table,
        gate: Gate,
        parts: Any,
        in_memory: bool,
        lifespan: tuple[Callable[[], None], Callable[[], None]],
    ) -> None:
        self.table, self.gate, self.parts, self.in_memory = table, gate, parts, in_memory
        self.lifespan = lifespan
        # POST paths the protocol may answer in the parser's callbacks: on the loop here
        self.hot = {r.path.encode(): r for r in table.routes if r.hot and r.on_loop(in_memory)}
        self._latency = {r.name: LATENCY.labels(r.name) for r in table.routes if r.counted}
        self._turns = {r.name: asyncio.Semaphore(r.at_once) for r in table.routes if r.at_once}
        self._requests: dict[tuple[str, int], Counter] = {}

    # ------------------------------------------------------------------ one request
    def refusal(
        self, route: Route, headers: Iterable[tuple[bytes, bytes]], client: Any
    ) -> Reply | None:
        """The gate's reply refusing this request (counted), or None."""
        started = time.perf_counter()
        refused = self.gate.refusal(route, headers, client)
        return None if refused is None else self.finish(route, started, refused)

    def answer(self, route: Route, call: Call, started: float) -> Reply:
        """``route``'s handler's reply to ``call`` (its errors answered), counted from
        ``started`` (``time.perf_counter()`` when its head was read)."""
        try:
            result = route.handler(self.parts, call)
        except Exception as exc:
            result = error_answer(route.name, exc)
        return self.finish(route, started, result)

    def finish(self, route: Route, started: float, result: Answer) -> Reply:
        """``result`` counted in the request metrics (if its route is) and rendered."""
        status = result[0]
        if route.counted:
            self._latency[route.name].observe(time.perf_counter() - started)
            counter = self._requests.get((route.name, status))
            if counter is None:
                counter = REQUESTS.labels(route.name, str(status))
                self._requests[(route.name, status)] = counter
            counter.inc()
        return render(result)

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # nothing here speaks another protocol
        reply = await self._reply(scope, receive)
        if reply is None:  # the client went away
            return
        status, body_bytes, headers = reply
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body_bytes})

    async def _reply(self, scope: Scope, receive: Receive) -> Reply | None:
        started = time.perf_counter()
        route, params, missing = self.table.find(scope["method"], scope["path"])
        if route is None:
            assert missing is not None
            return render(missing)  # no route: not counted
        refused = self.refusal(route, scope["headers"], scope.get("client"))
        if refused is not None:
            return refused
        body = b""
        if route.body is not None:
            read = await read_body(receive)
            if read is None:
                return None
            body = read
        call = Call(body, params, scope.get("query_string", b""))
        if route.on_loop(self.in_memory):
            return self.answer(route, call, started)
        turn = self._turns.get(route.name)
        if turn is None:
            return await run_in_threadpool(self.answer, route, call, started)
        async with turn:
            return await run_in_threadpool(self.answer, route, call, started)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        opened, closed = self.lifespan
        steps: dict[str, tuple[Callable[[], None], str]] = {
            "lifespan.startup": (opened, "lifespan.startup"),
            "lifespan.shutdown": (closed, "lifespan.shutdown"),
        }
        while True:
            message = await receive()
            step = steps.get(message["type"])
            if step is None:
                return
            action, name = step
            try:
                await run_in_threadpool(action)
            except Exception as exc:
                await send({"type": f"{name}.failed", "message": str(exc)})
                raise
            await send({"type": f"{name}.complete"})
            if name == "lifespan.shutdown":
                return


def render(result: Answer) -> Reply:
    """An answer as the bytes sent: JSON (compact, UTF-8, as Starlette's JSONResponse
    writes it) unless its payload is JSON already (bytes) or :class:`Raw`."""
    status, payload, extra = result
    media: str | None = "application/json"
    if isinstance(payload, Raw):
        body, media = payload.body, payload.media_type
        extra = {**(payload.headers or {}), **extra}
    elif isinstance(payload, bytes):
        body = payload
    else:
        body = json.dumps(
            payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
        ).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    if media is not None:
        headers.append((b"content-type", media.encode("latin-1")))
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return status, body, headers


async def read_body(receive: Callable[[], Awaitable[Any]]) -> bytes | None:
    """A request's whole body from ASGI messages (None: the client went away)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
