"""The lookup service (`kvledger serve`): prefix matches over HTTP for routers.

POST /v1/match    {"model", "group_idx", "hashes": [hex...] | "token_ids": [...],
                   "granularity"? ("block" | "hash", with hashes), "lora_name"?,
                   "cache_salt"? (with token_ids), "at"?,
                   "weights"?, "include_silent"?, "silent_after_s"?} → holders, a routing
                   rank, and the holders left out because their source is not live
POST /v1/decisions {"model", "group_idx"?, "instance", "token_ids" | "hashes", "lora_name"?,
                   "cache_salt"?, "request_id"?} → 202: the instance is a provisional holder
                   of the prompt's blocks for a short window (memory mode)
GET  /v1/blocks/{hash}   the block rows of a hash (hex) and their holders
GET  /healthz            the database answers (memory mode: the router's log position)
GET  /metrics            Prometheus metrics
GET  /openapi.json       this API described (OpenAPI 3.1; kvledger.client is a typed client)

SQL mode: every request runs in a read-only transaction, and the service refuses to start
with a role that can write to the index (log in as a member of kvledger_reader: `kvledger
roles create-reader`) unless told ``allow_writer``. Memory mode (``router=``, `kvledger serve
--memory`): /v1/match is answered by a RouterIndex; as-of lookups and block rows need the
SQL-backed service (400).
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from kvledger import __version__
from kvledger.consumer.metrics import REGISTRY as CONSUMER_REGISTRY
from kvledger.serving.lookup.hot import HotPath, HotRoute, Reply
from kvledger.serving.lookup.metrics import LATENCY, PROVISIONAL, REQUESTS
from kvledger.serving.lookup.metrics import REGISTRY as LOOKUP_REGISTRY
from kvledger.serving.lookup.openapi import document
from kvledger.serving.lookup.ratelimit import RateLimit
from kvledger.serving.lookup.requests import MAX_BODY_BYTES
from kvledger.serving.lookup.routes import Answer, Lookups, answer

if TYPE_CHECKING:
    from kvledger.schemas.decisions import Answered, Decision, Record
    from kvledger.serving.router.index import RouterIndex
    from kvledger.serving.router.provisional import Provisional

    # Records an answer no choice was reported for, its record built later.
    RecordAnswer = Callable[[Answered, Callable[[], Record]], None]

# Answered on the event loop in memory mode: microseconds, less than a hop to a thread.
_ON_LOOP = frozenset({"match", "decisions"})


class _KvledgerMetrics:
    """A registry's kvledger_* metrics, without the process's (exported once already)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return (m for m in self.registry.collect() if m.name.startswith("kvledger_"))


_CONSUMER_ONLY = _KvledgerMetrics(CONSUMER_REGISTRY)


# Decision reports a second per client address (and as many at once), each client's own.
DECISIONS_PER_CLIENT_S = 2000


class _Gate:
    """What every route checks and counts: the bearer token, the rate of decision reports
    per client, and each answer's latency and status."""

    def __init__(self, token: str | None) -> None:
        self.expected = f"Bearer {token}".encode() if token else None
        self.reports = RateLimit(DECISIONS_PER_CLIENT_S, DECISIONS_PER_CLIENT_S)

    def allowed(self, authorization: str) -> bool:
        return self.expected is None or hmac.compare_digest(authorization.encode(), self.expected)

    def admits(self, request: Request) -> bool:
        return self.allowed(request.headers.get("authorization", ""))

    @staticmethod
    def refused() -> Answer:
        return 401, {"error": "a bearer token is required"}, {"WWW-Authenticate": "Bearer"}

    def over_rate(self, request: Request) -> Answer | None:
        """A 429 when this client reports decisions faster than it may."""
        ok, wait = self.reports.allow(request.client.host if request.client else "")
        if ok:
            return None
        return 429, {"error": f"over {DECISIONS_PER_CLIENT_S} decision reports a second from "
                     "this client"}, {"Retry-After": str(max(1, math.ceil(wait)))}  # fmt: skip

    @staticmethod
    def counted(route: str, start: float, result: Answer) -> Answer:
        LATENCY.labels(route).observe(time.perf_counter() - start)
        REQUESTS.labels(route, str(result[0])).inc()
        return result


def _handler(gate: _Gate, route: str, fn: Any, with_body: bool, on_loop: bool) -> Any:
    """A route's handler: the gate's checks, then ``fn`` with the body or path parameters.
    ``on_loop``: answered on the event loop (from memory a lookup takes microseconds, less
    than a hop to a worker thread); the rest waits on the database or, for the router's
    /healthz, on the broker (the log end): in the thread pool, never blocking the loop."""

    async def handler(request: Request) -> Response:
        start = time.perf_counter()
        if route != "healthz" and not gate.admits(request):
            result = gate.refused()
        elif route == "decisions" and (limited := gate.over_rate(request)):
            result = limited
        elif with_body and (bad := length_error(request.headers.get("content-length"))):
            result = 400, {"error": bad}, {}
        else:
            arg = (await request.body()) if with_body else request.path_params
            result = (
                answer(route, fn, arg) if on_loop
                else await run_in_threadpool(answer, route, fn, arg)
            )  # fmt: skip
        status, payload, headers = gate.counted(route, start, result)
        return JSONResponse(payload, status, headers)

    return handler


def _routes(gate: _Gate, lookups: Lookups, in_memory: bool, openapi: Any) -> list[Route]:
    """The service's own routes (``/v1/*``, health, metrics, the document, the dashboard)."""

    def timed(route: str, fn: Any, with_body: bool = False) -> Any:
        return _handler(gate, route, fn, with_body, in_memory and route in _ON_LOOP)

    async def dashboard_data(request: Request) -> Response:
        start = time.perf_counter()
        if not gate.admits(request):
            result = gate.refused()
        else:
            params = dict(request.query_params)
            result = await run_in_threadpool(answer, "dashboard", lookups.dashboard, params)
        status, payload, headers = gate.counted("dashboard", start, result)
        if isinstance(payload, bytes):  # the shared answer, encoded once
            return Response(payload, status, headers, media_type="application/json")
        return JSONResponse(payload, status, headers)

    def metrics(request: Request) -> Response:
        if not gate.admits(request):
            status, payload, headers = gate.refused()
            return JSONResponse(payload, status, headers)
        body = generate_latest(LOOKUP_REGISTRY)
        if in_memory:  # the router's tail counts what it applies as a consumer does
            body += generate_latest(_CONSUMER_ONLY)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/v1/match", timed("match", lookups.match, with_body=True), methods=["POST"]),
        Route("/v1/blocks/{block_hash}", timed("blocks", lookups.block), methods=["GET"]),
        Route("/v1/decisions", timed("decisions", lookups.decide, True), methods=["POST"]),
        Route("/healthz", timed("healthz", lookups.healthz), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", lambda _: JSONResponse(openapi), methods=["GET"]),
        Route("/v1/dashboard", dashboard_data, methods=["GET"]),
        Route("/ui", _ui_file("index.html"), methods=["GET"]),
        Route("/ui/dashboard.js", _ui_file("dashboard.js"), methods=["GET"]),
        Route("/ui/chart.umd.min.js", _ui_file("vendor/chart.umd.min.js"), methods=["GET"]),
    ]


def _hot_match(gate: _Gate, lookups: Lookups) -> HotRoute:
    """POST /v1/match from memory, answered inside the HTTP parser (:mod:`.hot`)."""

    def refusal(authorization: str, length: str | None) -> Reply | None:
        if not gate.allowed(authorization):
            return _reply(gate.counted("match", time.perf_counter(), gate.refused()))
        if bad := length_error(length):
            return _reply(gate.counted("match", time.perf_counter(), (400, {"error": bad}, {})))
        return None

    def reply(raw: bytes, started: float) -> Reply:
        return _reply(gate.counted("match", started, answer("match", lookups.match, raw)))

    return HotRoute(refusal, reply)


def _dynamo(
    gate: _Gate, source: RouterIndex, silent_after: timedelta | None,
    provisional: Provisional | None, record: RecordAnswer | None,
) -> tuple[list[Route], dict[str, HotRoute]]:  # fmt: skip
    """NVIDIA Dynamo's KV-indexer routes over ``source`` (:mod:`.dynamo`)."""
    from kvledger.serving.lookup import dynamo, dynamo_http

    def refusal(request: Request) -> tuple[int, Any] | None:
        return None if gate.admits(request) else gate.refused()[:2]

    api = dynamo.DynamoApi(source, silent_after, provisional, record)
    return dynamo_http.routes(api, refusal), dynamo_http.hot_routes(api, gate.allowed)


def create_app(
    database_url: str | None = None,
    pool_size: int = 8,
    silent_after: timedelta | None = None,
    router: RouterIndex | None = None,
    token: str | None = None,
    statement_timeout_ms: int = 5000,
    pool_timeout_s: float = 5.0,
    allow_writer: bool = False,
    dynamo_api: bool = False,
    dynamo_router: RouterIndex | None = None,
    provisional: Provisional | None = None,
    share: Callable[[Decision, Record | None], None] | None = None,
    record_answer: RecordAnswer | None = None,
) -> ASGIApp:
    """The lookup service over the database (or, given ``router``, from memory);
    ``silent_after``: the liveness window (else the database's, or 30 s in memory).
    ``token``: every route but /healthz then requires ``Authorization: Bearer <token>``
    (401 without it). A lookup that runs past ``statement_timeout_ms`` or waits more than
    ``pool_timeout_s`` for a connection is answered 503 with Retry-After. The database role
    must not be able to write to the index (:class:`WriterRoleError`, raised here) unless
    ``allow_writer``. ``dynamo_api``: also serve NVIDIA Dynamo's KV-indexer routes
    (:mod:`.dynamo`), from ``dynamo_router`` or else ``router`` (built with
    ``dynamo=True``): Dynamo's routes are always answered from memory. ``provisional``
    (memory mode): POST /v1/decisions holds where routers sent prompts, and lookups answer
    those instances as provisional holders; ``share`` tells the other replicas, and
    ``record_answer`` records Dynamo's answers from ``router`` (a DecisionLog's
    note_answer)."""
    lookups = Lookups(
        database_url, pool_size, silent_after, router, statement_timeout_ms, pool_timeout_s,
        allow_writer, provisional, share,
    )  # fmt: skip
    if provisional is not None:
        PROVISIONAL.stores.add(provisional)
    gate = _Gate(token)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        lookups.open()
        try:
            yield
        finally:
            lookups.close()

    routes = _routes(gate, lookups, router is not None, document(dynamo_api))
    hot = {"/v1/match": _hot_match(gate, lookups)} if router is not None else {}
    if dynamo_api:
        source = dynamo_router or router
        if source is None:
            raise ValueError("Dynamo's API is served from memory: it needs a router")
        mine = source is router  # decisions are the memory mode's
        dynamo_routes, dynamo_hot = _dynamo(gate, source, silent_after,
                                            provisional if mine else None,
                                            record_answer if mine else None)  # fmt: skip
        routes = [*dynamo_routes, *routes]
        hot.update(dynamo_hot)
    # GET /: what this service is and what it answers (no token needed, as /openapi.json).
    index = {
        "service": "kvledger lookup service", "version": __version__,
        "mode": "memory" if router is not None else "sql", "dynamo_api": dynamo_api,
        "routes": sorted(f"{m} {r.path}" for r in routes for m in sorted(r.methods or ())
                         if m != "HEAD"),
        "openapi": "/openapi.json",
    }  # fmt: skip
    app = Starlette(
        routes=[*routes, Route("/", lambda _: JSONResponse(index), methods=["GET"])],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    return HotPath(app, hot) if hot else app


# The dashboard's page and scripts: no data in them (that is /v1/dashboard's, behind the
# token), and no script but these files may run on the page.
_UI_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
_UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _ui_file(name: str) -> Callable[[Request], Response]:
    from kvledger.serving.lookup.dashboard import UI

    path = UI / name

    def serve(_: Request) -> Response:
        try:
            body = path.read_bytes()
        except FileNotFoundError:
            why = (f"the dashboard's {name} is not installed here: scripts/vendor-ui "
                   "(which make venv runs, given npm) vendors the chart library")  # fmt: skip
            return JSONResponse({"error": why}, 503)
        return Response(body, media_type=_UI_TYPES[path.suffix], headers=_UI_HEADERS)

    return serve


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route 404, wrong method 405) as JSON errors, like
    every other answer of the API."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, exc.status_code, exc.headers)


def length_error(length: str | None) -> str | None:
    """Why a request body of Content-Length ``length`` is refused (None: it is not)."""
    if length is None or not (length.isascii() and length.isdigit()):
        return "a JSON body with Content-Length is required"
    if int(length) > MAX_BODY_BYTES:
        return f"body over {MAX_BODY_BYTES} bytes"
    return None


def _reply(result: Answer) -> Reply:
    """An answer as a hot route's reply: JSON as Starlette's JSONResponse renders it."""
    status, payload, headers = result
    body = json.dumps(
        payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()
    return status, body, [(k.lower().encode("latin-1"), v.encode("latin-1"))
                          for k, v in headers.items()]  # fmt: skip
