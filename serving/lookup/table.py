"""The lookup service's route table: every route it serves, one entry each, and nothing
served that is not in it.

An entry (:class:`Route`) says everything about its route: its method and path, its
handler, who may call it (:data:`Role`), the body it takes and its bound (:class:`Body`),
its rate class, where it runs (on the event loop, or in the thread pool), whether the
protocol answers it in the HTTP parser's callbacks (``hot``), and its OpenAPI facts
(summary, parameters, request schema, answers). :mod:`.door` serves the table, and checks
every request against its entry in one place; :func:`.openapi.document` describes it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl

from kvledger.serving.lookup import dynamo_requests, requests
from kvledger.serving.lookup.openapi import (
    BLOCK_HASH,
    ERROR_REF,
    ERRORS,
    GONE,
    INDEX,
    MINUTES,
    UI_MISSING,
    UI_PAGE,
    UI_SCRIPT,
    ref,
    response,
)
from kvledger.serving.lookup.openapi_dynamo import DYNAMO_ERRORS, UNREGISTER

if TYPE_CHECKING:
    from kvledger.serving.lookup.http import Parts

# A route's answer: status, payload (JSON-able, JSON bytes already, or a Raw body), headers.
Answer = tuple[int, Any, dict[str, str]]
# Who may call a route: anyone, or a holder of the token of the role.
Role = Literal["open", "read", "write"]
# Where a route runs: on the event loop (microseconds: less than a hop to a thread), in the
# thread pool (it waits on the database or the broker), or on the loop from memory only.
Run = Literal["loop", "thread", "memory"]


@dataclass(frozen=True, slots=True)
class Body:
    """A request body a route reads: at most ``max_bytes`` (by its Content-Length, which it
    must have: ``missing`` without it, ``over`` past the bound), described by ``schema``."""

    max_bytes: int
    missing: int
    over: int
    schema: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Raw:
    """A payload sent as it is, of ``media_type`` (None: no Content-Type)."""

    body: bytes
    media_type: str | None
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """One request as a handler reads it: its body, its path parameters, its query."""

    body: bytes
    params: Mapping[str, str]
    query_string: bytes

    def query(self) -> dict[str, str]:
        """The query parameters (the last of a repeated name)."""
        return dict(parse_qsl(self.query_string.decode("latin-1"), keep_blank_values=True))


Handler = Callable[["Parts", Call], Answer]


@dataclass(frozen=True, slots=True)
class Route:
    """One route of the service (see the module docstring). ``name``: its operationId and
    its metrics' ``route`` label (``counted``: in the request metrics); ``responses``: its
    own documented answers (the gate's 401, 411/413, 429 are added from its entry)."""

    method: Literal["GET", "POST"]
    path: str
    name: str
    handler: Handler
    summary: str
    responses: Mapping[str, Any]
    role: Role = "read"
    body: Body | None = None
    rate: str | None = None
    run: Run = "thread"
    hot: bool = False
    counted: bool = True
    dynamo: bool = False
    parameters: tuple[Mapping[str, Any], ...] = ()
    # At most this many answered at a time (None: no bound but the pool's); the rest wait
    # their turn without holding a thread, so a flood of them leaves the pool to the others.
    at_once: int | None = None

    def on_loop(self, in_memory: bool) -> bool:
        """Whether it is answered on the event loop (else in the thread pool)."""
        return self.run == "loop" or (self.run == "memory" and in_memory)


# The bodies' bounds: the service's own (a 400 refuses them, as any malformed request) and
# Dynamo's (its own codes).
def _lookup_body(schema: str) -> Body:
    return Body(requests.MAX_BODY_BYTES, 400, 400, ref(schema))


def _dynamo_body(schema: Mapping[str, Any]) -> Body:
    return Body(dynamo_requests.MAX_BODY_BYTES, 411, 413, schema)


def _json(schema: Mapping[str, Any], description: str) -> dict[str, Any]:
    return response(dict(schema), description)


def _ui(path: str, name: str, file: str, page: bool = False) -> Route:
    return Route(
        "GET",
        path,
        name,
        lambda p, _: p.ui_file(file),
        "The dashboard's page (no token needed)" if page else f"The dashboard's {file}",
        {"200": UI_PAGE if page else UI_SCRIPT, "503": UI_MISSING},
        role="open",
        counted=False,
    )


SERVICE: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/match",
        "match",
        lambda p, c: p.lookups.match(c.body),
        "Holders of a prompt's prefix, their ranking, and who was left out",
        {"200": _json(ref("MatchAnswer"), "The match"), **ERRORS, "410": GONE},
        body=_lookup_body("MatchRequest"),
        run="memory",
        hot=True,
    ),
    Route(
        "POST",
        "/v1/decisions",
        "decisions",
        lambda p, c: p.lookups.decide(c.body),
        "A router sent a prompt to an instance: answered as a provisional holder of its "
        "blocks for a short window (memory mode)",
        {"202": _json(ref("DecisionAnswer"), "Held"), **ERRORS},
        role="write",
        body=_lookup_body("DecisionRequest"),
        rate="decisions",
        run="memory",
    ),
    Route(
        "GET",
        "/v1/blocks/{block_hash}",
        "blocks",
        lambda p, c: p.lookups.block(c.params),
        "What the index knows of one block hash (SQL mode)",
        {
            "200": _json(
                {"type": "array", "items": ref("Block")}, "Its rows (one per model and group)"
            ),
            "404": response(ERROR_REF, "Unknown block hash"),
            **ERRORS,
        },
        parameters=(BLOCK_HASH,),
    ),
    Route(
        "GET",
        "/v1/dashboard",
        "dashboard",
        lambda p, c: p.lookups.dashboard(c.query()),
        "The fleet at a glance, as the dashboard (GET /ui) draws it: sources now, occupancy, "
        "the reuse funnel, restarts and losses, shared prefixes (from memory: the sources only)",
        {
            "200": _json(
                {"type": "object", "required": ["mode", "minutes", "fleet"]},
                "The window's figures (docs/operations.md)",
            ),
            **ERRORS,
        },
        parameters=(MINUTES,),
        at_once=2,
    ),
    Route(
        "GET",
        "/healthz",
        "healthz",
        lambda p, _: p.lookups.healthz(None),
        "The service answers (no token needed)",
        {"200": _json(ref("Health"), "Healthy"), "503": _json(ref("Health"), "Not serving")},
        role="open",
    ),
    Route(
        "GET",
        "/metrics",
        "metrics",
        lambda p, _: p.metrics(),
        "Prometheus metrics (text exposition format)",
        {
            "200": {
                "description": "Metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
        counted=False,
    ),
    Route(
        "GET",
        "/",
        "index",
        lambda p, _: (200, p.index, {}),
        "What this service is, its mode and its routes (no token needed)",
        {"200": _json(INDEX, "The service")},
        role="open",
        run="loop",
        counted=False,
    ),
    Route(
        "GET",
        "/openapi.json",
        "openapi",
        lambda p, _: (200, p.document, {}),
        "This document (no token needed)",
        {"200": _json({"type": "object"}, "The OpenAPI document")},
        role="open",
        run="loop",
        counted=False,
    ),
    _ui("/ui", "ui", "index.html", page=True),
    _ui("/ui/dashboard.js", "ui_script", "dashboard.js"),
    _ui("/ui/chart.umd.min.js", "ui_chart", "vendor/chart.umd.min.js"),
)


def _dynamo_post(
    path: str,
    summary: str,
    handler: Handler,
    request: Mapping[str, Any],
    answer: tuple[str, str] = ("200", "DynamoScores"),
) -> Route:
    status, schema = answer
    name = "dynamo_" + path.strip("/")
    return Route(
        "POST",
        path,
        name,
        handler,
        summary,
        {status: _json(ref(schema), "Done"), **DYNAMO_ERRORS},
        role="read" if path.startswith("/query") else "write",
        body=_dynamo_body(request),
        run="loop",
        hot=path.startswith("/query"),
        dynamo=True,
    )


def _workers(p: Parts, c: Call) -> Answer:
    q = c.query()
    return (*p.dynamo.list_workers(q.get("model_name"), q.get("routing_group")), {})


DYNAMO: tuple[Route, ...] = (
    _dynamo_post(
        "/query",
        "Dynamo: each worker's match of a prompt's tokens",
        lambda p, c: (*p.dynamo.query(c.body, False), {}),
        ref("DynamoQuery"),
    ),
    _dynamo_post(
        "/query_by_hash",
        "Dynamo: each worker's match of a prompt's local block hashes",
        lambda p, c: (*p.dynamo.query(c.body, True), {}),
        ref("DynamoQueryByHash"),
    ),
    _dynamo_post(
        "/register",
        "Dynamo: register a worker",
        lambda p, c: (*p.dynamo.register(c.body), {}),
        ref("DynamoRegistration"),
        ("201", "DynamoStatus"),
    ),
    _dynamo_post(
        "/unregister",
        "Dynamo: unregister a worker's registrations",
        lambda p, c: (*p.dynamo.unregister(c.body), {}),
        UNREGISTER,
        ("200", "DynamoStatus"),
    ),
    Route(
        "GET",
        "/workers",
        "dynamo_workers",
        _workers,
        "Dynamo: the workers (kvledger's sources)",
        {"200": _json({"type": "array", "items": ref("DynamoWorker")}, "The workers")},
        dynamo=True,
        parameters=tuple(
            {"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
            for n in ("model_name", "routing_group")
        ),
    ),
    Route(
        "GET",
        "/dump",
        "dynamo_dump",
        lambda p, _: (*p.dynamo.dump(), {}),
        "Dynamo: every live worker's blocks as Dynamo's stored events, per model:routing_group",
        {"200": _json({"type": "object"}, "The events")},
        dynamo=True,
    ),
    Route(
        "GET",
        "/health",
        "dynamo_health",
        lambda p, _: (200, Raw(b"", None), {}),
        "Dynamo: 200",
        {"200": {"description": "Up"}},
        role="open",
        run="loop",
        counted=False,
        dynamo=True,
    ),
)


def routes(dynamo_api: bool) -> tuple[Route, ...]:
    """The service's routes: its own, then Dynamo's where it serves them."""
    return (*SERVICE, *DYNAMO) if dynamo_api else SERVICE


def document(dynamo_api: bool) -> dict[str, Any]:
    """The OpenAPI document of the service's table (with Dynamo's routes or not)."""
    from kvledger.serving.lookup.openapi import document as described

    return described(routes(dynamo_api))


_PARAM = re.compile(r"\{(\w+)\}")


class Table:
    """The routes by method and path: :meth:`find` names a request's route, or the 404 or
    405 that refuses it."""

    def __init__(self, table: tuple[Route, ...]) -> None:
        self.routes = table
        self._exact: dict[str, dict[str, Route]] = {}
        self._templates: list[tuple[re.Pattern[str], dict[str, Route]]] = []
        templates: dict[str, dict[str, Route]] = {}
        for route in table:
            if _PARAM.search(route.path):
                by_method = templates.setdefault(route.path, {})
            else:
                by_method = self._exact.setdefault(route.path, {})
            if route.method in by_method:
                raise ValueError(f"{route.method} {route.path} is in the table twice")
            by_method[route.method] = route
        for path, by_method in templates.items():
            parts = _PARAM.split(path)  # text, a name, text, ...
            pattern = "".join(
                re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)"
                for i, part in enumerate(parts)
            )
            self._templates.append((re.compile(f"^{pattern}$"), by_method))
        # POST paths answered in the HTTP parser's callbacks (set by the service, per mode)
        self.hot: dict[bytes, Route] = {}

    def find(self, method: str, path: str) -> tuple[Route | None, dict[str, str], Answer | None]:
        """``(route, path parameters, None)``, or ``(None, {}, refusal)``: a 404 where no
        route has the path, a 405 (with Allow) where none has it with this method. A HEAD
        is answered as the GET."""
        params: dict[str, str] = {}
        by_method = self._exact.get(path)
        if by_method is None:
            for pattern, candidates in self._templates:
                if found := pattern.match(path):
                    by_method, params = candidates, found.groupdict()
                    break
            else:
                return None, {}, (404, {"error": "Not Found"}, {})
        route = by_method.get("GET" if method == "HEAD" else method)
        if route is None:
            allowed = sorted({*by_method, *(["HEAD"] if "GET" in by_method else [])})
            return None, {}, (405, {"error": "Method Not Allowed"}, {"Allow": ", ".join(allowed)})
        return route, params, None
