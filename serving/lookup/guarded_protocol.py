"""uvicorn's httptools protocol with the limits a public-facing server needs, checked as the
bytes arrive and before any authentication or route:

- a request's head (request line and headers) is refused over ``max_head_bytes`` (431) or
  ``max_headers`` headers (431), its target over ``max_url_bytes`` (414): counted as the
  bytes arrive, so a header that never ends takes no more than the bound;
- a body is refused over ``max_body_bytes``: at once from its Content-Length, or as a
  chunked body grows past it (413), and the connection closed (its rest is never read);
- a request must arrive whole in time: its head within ``head_timeout_s`` of its first
  byte (or of the connection, for a client that sends nothing), its body within
  ``body_timeout_s`` of its head (408, and the connection closed);
- a protocol upgrade (``Connection: Upgrade``: h2c, WebSocket) is refused on every route:
  nothing here speaks another protocol, and a body after an upgrade must never be read as
  a second request;
- at most ``max_connections`` connections: the next one closes the longest waiting for a
  request head (a slow or silent client), else is itself closed.

A connection costs the server little before it sends a request, since a flood of them is
the attack: its addresses are read when a request needs them, and its deadlines are kept
in one book per server (one timeout each, so oldest first is soonest first) that a single
timer sweeps, not one timer per connection.

Every refusal is logged at most once a second with a count, so a flood cannot flood the
log either. tests/unit/test_guarded_protocol.py runs it in real servers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_local_addr, get_remote_addr

logger = logging.getLogger(__name__)

_REASONS = {
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    400: b"Bad Request",
}


@dataclass(frozen=True)
class HttpLimits:
    """What one request and the server's connections may take (see the module docstring)."""

    max_head_bytes: int = 16 * 1024
    max_url_bytes: int = 8 * 1024
    max_headers: int = 100
    max_body_bytes: int = 8 * 1024 * 1024
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096


class RefusedError(Exception):
    """A request refused by a limit (raised in a parser callback): its status and reason,
    or the whole ``response`` to send instead."""

    def __init__(self, status: int, reason: str, response: bytes | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.response = status, reason, response


class _Refusals:
    """Refusals counted by reason and logged at most once a second."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged = 0.0

    def count(self, reason: str) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self._logged >= 1.0:
            self._logged = now
            logger.warning("refused requests so far: %s", dict(self.counts))


_HEAD, _BODY = "a request head", "a request body"
_UNREAD: Any = object()  # an address not read yet


class _Deadlines:
    """A server's connections awaiting a request head (``heads``) or body (``bodies``),
    each book ordered by deadline (every entry of a book has the same timeout, so the
    oldest is the soonest), and the one timer that sweeps both."""

    def __init__(self) -> None:
        self.heads: OrderedDict[GuardedProtocol, float] = OrderedDict()
        self.bodies: OrderedDict[GuardedProtocol, float] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(
        self,
        book: OrderedDict[GuardedProtocol, float],
        connection: GuardedProtocol,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.end(connection)
        book[connection] = loop.time() + timeout
        if self._timer is None or self._loop is not loop:  # none yet, or a loop gone
            self._loop, tick = loop, self.tick(connection.limits)
            self._timer = loop.call_later(tick, self._sweep, loop, tick)

    def end(self, connection: GuardedProtocol) -> None:
        self.heads.pop(connection, None)
        self.bodies.pop(connection, None)

    @staticmethod
    def tick(limits: HttpLimits) -> float:
        """How often the books are swept: a tenth of the shortest timeout, within 10 ms
        to 250 ms (a deadline is kept that much late at most)."""
        return min(max(min(limits.head_timeout_s, limits.body_timeout_s) / 10, 0.01), 0.25)

    def _sweep(self, loop: asyncio.AbstractEventLoop, tick: float) -> None:
        self._timer = None
        now, expired = loop.time(), []
        for book, what in ((self.heads, _HEAD), (self.bodies, _BODY)):
            for connection, deadline in book.items():
                if deadline > now:
                    break
                expired.append((connection, what))
        for connection, what in expired:
            self.end(connection)
            connection._timed_out(what)
        if self.heads or self.bodies:
            self._timer = loop.call_later(tick, self._sweep, loop, tick)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol within :class:`HttpLimits` (see the module docstring).
    A subclass per server (:func:`guarded`) holds its limits and its connections' deadlines
    (those waiting for a request head, oldest first, are ``waiting``)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    deadlines: ClassVar[_Deadlines] = _Deadlines()
    refusals: ClassVar[_Refusals] = _Refusals()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._header_count = 0
        self._body_bytes = 0
        self._in_head = True
        self._server: Any = _UNREAD
        self._client: Any = _UNREAD

    @property
    def waiting(self) -> OrderedDict[GuardedProtocol, float]:
        """This server's connections waiting for a request head, oldest first."""
        return self.deadlines.heads

    # uvicorn's protocol reads both addresses as a connection is made; here they are read
    # when a request (its scope, a log line) asks, so a connection that never sends a
    # request costs no system calls for them.
    @property
    def server(self) -> tuple[str, int | None] | None:
        if self._server is _UNREAD:
            self._server = get_local_addr(self.transport) if self.transport else None
        return self._server  # type: ignore[no-any-return]

    @server.setter
    def server(self, value: tuple[str, int | None] | None) -> None:
        self._server = value

    @property
    def client(self) -> tuple[str, int] | None:
        if self._client is _UNREAD:
            self._client = get_remote_addr(self.transport) if self.transport else None
        return self._client  # type: ignore[no-any-return]

    @client.setter
    def client(self, value: tuple[str, int] | None) -> None:
        self._client = value

    # ------------------------------------------------------------------ connections
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # uvicorn's connection_made, less reading the addresses (see above)
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.scheme = "https" if self.config.is_ssl else "http"
        if len(self.connections) > self.limits.max_connections:
            oldest = next(iter(self.waiting), None)
            if oldest is None:
                self.refusals.count("connections")
                transport.close()
                return
            self.refusals.count("connections: the longest waiting closed")
            oldest._drop()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadlines.end(self)
        super().connection_lost(exc)

    # ------------------------------------------------------------------ reading
    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
            if self._in_head and self._head_bytes > self.limits.max_head_bytes:
                raise RefusedError(431, f"a request head over {self.limits.max_head_bytes} bytes")
        except RefusedError as exc:
            self._refuse(exc)
        except httptools.HttpParserUpgrade:
            self._refuse(RefusedError(400, "protocol upgrades are not served"))
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._refuse(
                cause
                if isinstance(cause, RefusedError)
                else RefusedError(400, "an invalid request")
            )

    def on_message_begin(self) -> None:
        # uvicorn's, with the scope's addresses left to on_headers_complete: a hot route
        # never reads them, and a head that never ends never needs them
        self.url, self.expect_100_continue, self.headers = b"", False, []
        self.scope = {  # type: ignore[typeddict-item]  # as uvicorn: the rest at the head
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": None,
            "client": None,
            "scheme": self.scheme or "http",
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        self._header_count = self._body_bytes = 0
        if self not in self.waiting:
            self._await_head()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            raise RefusedError(414, f"a request target over {self.limits.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            raise RefusedError(431, f"over {self.limits.max_headers} headers")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.head_read()
        self.scope["server"], self.scope["client"] = self.server, self.client
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self.body_read(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self.message_read()
        super().on_message_complete()

    # The limits' part of the parser callbacks (a subclass answering a request itself calls
    # them where it does not call uvicorn's).
    def head_read(self) -> None:
        """A request's head is in: refused if it upgrades or its body is too large; its
        body then has ``body_timeout_s`` to arrive."""
        self._in_head = False
        self.deadlines.end(self)
        if self.parser.should_upgrade():
            raise RefusedError(400, "protocol upgrades are not served")
        length = self.content_length()
        if length is not None and length > self.limits.max_body_bytes:
            raise RefusedError(413, f"a body over {self.limits.max_body_bytes} bytes")
        self.deadlines.start(self.deadlines.bodies, self, self.limits.body_timeout_s, self.loop)

    def body_read(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            raise RefusedError(413, f"a body over {self.limits.max_body_bytes} bytes")

    def message_read(self) -> None:
        self.deadlines.end(self)
        self._in_head, self._head_bytes = True, 0

    def content_length(self) -> int | None:
        """The request's Content-Length (None: none, or not a number)."""
        for name, value in self.headers:
            if name == b"content-length":
                return int(value) if value.isdigit() else None
        return None

    # ------------------------------------------------------------------ internals
    def _await_head(self) -> None:
        self.deadlines.start(self.deadlines.heads, self, self.limits.head_timeout_s, self.loop)

    def _timed_out(self, what: str) -> None:
        """Called by the deadlines' sweep: ``what`` (a request head or body) is late."""
        timeout = self.limits.head_timeout_s if what == _HEAD else self.limits.body_timeout_s
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes == 0:  # a connection that sent nothing
            self.refusals.count("connections idle past the head timeout")
            self._drop()
        elif not self._in_head and self.cycle is not None and self.cycle.response_started:
            self._drop()  # mid-answer: nothing more can be said
        else:
            self._refuse(RefusedError(408, f"{what} not received within {timeout:g} s"))

    def _refuse(self, refused: RefusedError) -> None:
        """Send the refusal (JSON, as every answer of the service) and close the
        connection: what follows on it is never read."""
        self.refusals.count(refused.reason)
        response = refused.response
        if response is None:
            body = b'{"error":"' + refused.reason.encode("ascii", "replace") + b'"}'
            status = refused.status
            head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Error"))]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
            response = b"".join(head) + body
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's request ends: it answers no one
        self.transport.write(response)
        self._drop()

    def _drop(self) -> None:
        self.deadlines.end(self)
        self.transport.close()


def guarded(base: type[GuardedProtocol], limits: HttpLimits, **attrs: Any) -> type[Any]:
    """A protocol class of its own for one server: ``base`` with ``limits``, its own
    connections' deadlines and its own refusal counts (and ``attrs``)."""
    return type(
        base.__name__,
        (base,),
        {"limits": limits, "deadlines": _Deadlines(), "refusals": _Refusals(), **attrs},
    )
