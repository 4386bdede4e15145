"""The lookup service (`kvledger serve`): prefix matches over HTTP for routers.

POST /v1/match    {"model", "group_idx", "hashes": [hex...] | "token_ids": [...],
                   "granularity"? ("block" | "hash", with hashes), "lora_name"?,
                   "cache_salt"? (with token_ids), "at"?,
                   "weights"?, "include_silent"?, "silent_after_s"?} → holders, a routing
                   rank, and the holders left out because their source is not live
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
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from kvledger.consumer.db import (
    SCHEMA_MISSING,
    SCHEMA_MISSING_ERRORS,
    SchemaMissingError,
    conninfo,
)
from kvledger.consumer.lookup.api import (
    NotRetainedError,
    PrefixIndex,
    rank,
    split_live,
    unknown_group,
)
from kvledger.consumer.lookup.hot import HotPath, HotRoute, Reply
from kvledger.consumer.lookup.metrics import LATENCY, REQUESTS
from kvledger.consumer.lookup.metrics import REGISTRY as LOOKUP_REGISTRY
from kvledger.consumer.lookup.openapi import DOCUMENT
from kvledger.consumer.lookup.requests import (
    MAX_BODY_BYTES,
    BadRequestError,
    MatchRequest,
    parse_json,
    parse_match,
    parse_path_hash,
)
from kvledger.consumer.metrics import REGISTRY as CONSUMER_REGISTRY
from kvledger.consumer.roles import WriterRoleError, ensure_read_only
from kvledger.schemas.lookup import Holder
from kvledger.schemas.redact import redact

if TYPE_CHECKING:
    from kvledger.consumer.router.index import RouterIndex

logger = logging.getLogger(__name__)


class _KvledgerMetrics:
    """A registry's kvledger_* metrics, without the process's (exported once already)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return (m for m in self.registry.collect() if m.name.startswith("kvledger_"))


_CONSUMER_ONLY = _KvledgerMetrics(CONSUMER_REGISTRY)
# A route's answer: status, JSON body, extra headers.
Answer = tuple[int, Any, dict[str, str]]


# Whether the server is a hot standby, and its replay lag: the time since the last replayed
# transaction committed on the primary, 0 when it has replayed everything it received.
_STANDBY = """
SELECT pg_is_in_recovery(),
       CASE WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN interval '0'
            ELSE now() - pg_last_xact_replay_timestamp() END,
       pg_last_wal_replay_lsn()
"""


def _configure(conn: psycopg.Connection, statement_timeout_ms: int) -> None:
    conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    # Last: it bounds every later statement, the set-up's own included.
    conn.execute(f"SET statement_timeout = {int(statement_timeout_ms)}")


_FIELDS: dict[type, tuple[str, ...]] = {}


def _holder_json(h: Any) -> dict[str, Any]:
    """A Holder or Ranked as JSON (dataclasses.asdict, without its deep copy: ~4x faster)."""
    names = _FIELDS.get(type(h))
    if names is None:
        names = _FIELDS[type(h)] = tuple(f.name for f in fields(h))
    return {name: getattr(h, name) for name in names}


class _MemoryLookups:
    """The lookup API's shape over a RouterIndex (no history, no block rows)."""

    def __init__(self, router: RouterIndex) -> None:
        self.router = router
        self.match = router.match
        self.match_tokens = router.match_tokens

    def match_at(self, *args: object) -> list[Holder]:
        raise BadRequestError("as-of lookups are served by the SQL-backed service")

    def blocks(self, block_hash: bytes) -> list[Any]:
        raise BadRequestError("block rows are served by the SQL-backed service")

    def knows_group(self, model: str, group_idx: int) -> bool:
        return self.router.knows_group(model, group_idx)


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
) -> ASGIApp:
    """The lookup service over the database (or, given ``router``, from memory);
    ``silent_after``: the liveness window (else the database's, or 30 s in memory).
    ``token``: every route but /healthz then requires ``Authorization: Bearer <token>``
    (401 without it). A lookup that runs past ``statement_timeout_ms`` or waits more than
    ``pool_timeout_s`` for a connection is answered 503 with Retry-After. The database role
    must not be able to write to the index (:class:`WriterRoleError`, raised here) unless
    ``allow_writer``. ``dynamo_api``: also serve NVIDIA Dynamo's KV-indexer routes
    (:mod:`.dynamo`), from ``dynamo_router`` or else ``router`` (built with
    ``dynamo=True``): Dynamo's routes are always answered from memory."""
    expected = f"Bearer {token}".encode() if token else None

    def allowed(authorization: str) -> bool:
        return expected is None or hmac.compare_digest(authorization.encode(), expected)

    def refused() -> Answer:
        return 401, {"error": "a bearer token is required"}, {"WWW-Authenticate": "Bearer"}

    def window(req: MatchRequest) -> timedelta | None:
        return req.silent_after if req.silent_after is not None else silent_after

    pool = (
        ConnectionPool(
            conninfo(database_url),
            min_size=1,
            max_size=pool_size,
            configure=lambda conn: _configure(conn, statement_timeout_ms),
            kwargs={"autocommit": True},
            open=False,
        )
        if database_url is not None
        else None
    )
    if pool is None and router is None:
        raise ValueError("create_app needs a database URL or a router")
    # The role is checked before serving; on a database not migrated yet (the service
    # started first, as containers may) it is checked again before each request until
    # the schema is there, and until then every lookup is a 503 that says why.
    role_unchecked = database_url is not None and not allow_writer
    if role_unchecked:
        assert database_url is not None
        try:
            ensure_read_only(database_url)
            role_unchecked = False
        except SchemaMissingError:
            logger.warning("%s; until then every lookup is answered 503", SCHEMA_MISSING)

    def check_role() -> None:
        nonlocal role_unchecked
        if role_unchecked:
            assert database_url is not None
            ensure_read_only(database_url)  # SchemaMissingError, WriterRoleError: a 503
            role_unchecked = False

    @contextmanager
    def index() -> Iterator[Any]:
        if router is not None:
            yield _MemoryLookups(router)
            return
        assert pool is not None
        check_role()
        with pool.connection(timeout=pool_timeout_s) as conn:
            yield PrefixIndex(conn)

    def answer(route: str, fn: Any, arg: Any) -> Answer:
        """``fn(arg)``'s answer, or the error answer of what it raised."""
        try:
            result: Answer = fn(arg)
            return result
        except BadRequestError as exc:
            return 400, {"error": str(exc)}, {}
        except NotRetainedError as exc:  # the history asked about is gone, for good
            return 410, {"error": str(exc)}, {}
        except (PoolTimeout, psycopg.errors.QueryCanceled) as exc:
            why = "no database connection free" if isinstance(exc, PoolTimeout) else (
                "the lookup ran past the statement timeout"
            )  # fmt: skip
            return 503, {"error": why}, {"Retry-After": "1"}
        except SCHEMA_MISSING_ERRORS:
            return 503, {"error": SCHEMA_MISSING}, {"Retry-After": "30"}
        except WriterRoleError as exc:
            return 503, {"error": str(exc)}, {"Retry-After": "30"}
        except psycopg.OperationalError as exc:
            return 503, {"error": f"database unavailable: {redact(str(exc))}"}, {"Retry-After": "5"}
        except Exception:  # a bug: answered and counted as a 500, never a dropped request
            logger.exception("lookup %s failed", route)
            return 500, {"error": "internal error"}, {}

    def counted(route: str, start: float, result: Answer) -> Answer:
        LATENCY.labels(route).observe(time.perf_counter() - start)
        REQUESTS.labels(route, str(result[0])).inc()
        return result

    def timed(route: str, fn: Any, with_body: bool = False) -> Any:
        async def handler(request: Request) -> Response:
            start = time.perf_counter()
            if route != "healthz" and not allowed(request.headers.get("authorization", "")):
                result = refused()
            elif with_body and (bad := length_error(request.headers.get("content-length"))):
                result = 400, {"error": bad}, {}
            else:
                arg = (await request.body()) if with_body else request.path_params
                # From memory a lookup takes microseconds: answered on the event loop (a
                # hop to a worker thread would cost more than the lookup). The rest waits
                # on the database or, for the router's /healthz, on the broker (the log
                # end): in the thread pool, never blocking the loop.
                result = (
                    answer(route, fn, arg) if router is not None and route == "match"
                    else await run_in_threadpool(answer, route, fn, arg)
                )  # fmt: skip
            status, payload, headers = counted(route, start, result)
            return JSONResponse(payload, status, headers)

        return handler

    def match(raw: bytes) -> Answer:
        req = parse_match(parse_json(raw))
        left_out: list[Holder] = []
        with index() as idx:
            if req.token_ids is not None:
                holders = idx.match_tokens(
                    req.model, req.group_idx, req.token_ids, req.lora_name, True, window(req),
                    req.cache_salt,
                )  # fmt: skip
            elif req.at is not None:
                assert req.hashes is not None
                holders = idx.match_at(
                    req.model, req.group_idx, req.hashes, req.at, req.granularity
                )
            else:
                assert req.hashes is not None
                holders = idx.match(
                    req.model, req.group_idx, req.hashes, req.granularity, True, window(req)
                )
            # Only an empty answer asks whether the group is known: a hit pays nothing.
            unknown = not holders and not idx.knows_group(req.model, req.group_idx)
        if req.at is None and not req.include_silent:
            holders, left_out = split_live(holders)
        ranked = rank(holders, req.weights)
        body: dict[str, Any] = {
            "holders": [_holder_json(h) for h in holders],
            "ranked": [_holder_json(r) for r in ranked],
            "left_out": [_holder_json(h) for h in left_out],
        }
        if unknown:
            body["unknown_group"] = unknown_group(req.model, req.group_idx)
        return 200, body, {}

    def block(params: dict[str, Any]) -> Answer:
        rows = []
        with index() as idx:
            for h in parse_path_hash(params["block_hash"]):  # the likeliest reading first
                if rows := idx.blocks(h):
                    break
        if not rows:
            return 404, {"error": "unknown block hash"}, {}
        return 200, [_block_json(b) for b in rows], {}

    def healthz(_: object) -> Answer:
        if router is not None:
            position = router.position()
            status = "ok" if position.error is None else "stopped"
            body = {"status": status, "mode": "memory", "position": asdict(position)}
            return (200 if position.error is None else 503), body, {}
        with index() as idx:
            idx.conn.execute("SELECT 1 FROM kvledger.group_specs LIMIT 1")
            row = idx.conn.execute(_STANDBY).fetchone()
        if row is None or not row[0]:
            return 200, {"status": "ok"}, {}
        # A hot standby: how far its replay is behind (None before any replayed commit).
        lag = row[1]
        return 200, {
            "status": "ok", "standby": True,
            "replay_lag_s": lag.total_seconds() if lag is not None else None,
            "replay_lsn": str(row[2]) if row[2] is not None else None,
        }, {}  # fmt: skip

    def match_refusal(authorization: str, length: str | None) -> Reply | None:
        if not allowed(authorization):
            return _reply(counted("match", time.perf_counter(), refused()))
        if bad := length_error(length):
            return _reply(counted("match", time.perf_counter(), (400, {"error": bad}, {})))
        return None

    def match_reply(raw: bytes, started: float) -> Reply:
        return _reply(counted("match", started, answer("match", match, raw)))

    def metrics(request: Request) -> Response:
        if not allowed(request.headers.get("authorization", "")):
            status, payload, headers = refused()
            return JSONResponse(payload, status, headers)
        body = generate_latest(LOOKUP_REGISTRY)
        if router is not None:  # the router's tail counts what it applies as a consumer does
            body += generate_latest(_CONSUMER_ONLY)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if pool is None:
            yield
            return
        pool.open()
        try:
            yield
        finally:
            pool.close()

    extra: list[Route] = []
    hot = {"/v1/match": HotRoute(match_refusal, match_reply)} if router is not None else {}
    if dynamo_api:
        from kvledger.consumer.lookup import dynamo, dynamo_http

        source = dynamo_router or router
        if source is None:
            raise ValueError("Dynamo's API is served from memory: it needs a router")

        def refusal(request: Request) -> tuple[int, Any] | None:
            return None if allowed(request.headers.get("authorization", "")) else refused()[:2]

        dynamo_api_ = dynamo.DynamoApi(source, silent_after)
        extra = dynamo_http.routes(dynamo_api_, refusal)
        hot.update(dynamo_http.hot_routes(dynamo_api_, allowed))
    app = Starlette(
        routes=[
            *extra,
            Route("/v1/match", timed("match", match, with_body=True), methods=["POST"]),
            Route("/v1/blocks/{block_hash}", timed("blocks", block), methods=["GET"]),
            Route("/healthz", timed("healthz", healthz), methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", lambda _: JSONResponse(DOCUMENT), methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    return HotPath(app, hot) if hot else app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route 404, wrong method 405) as JSON errors, like
    every other answer of the API."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, exc.status_code, exc.headers)


def length_error(length: str | None) -> str | None:
    """Why a request body of Content-Length ``length`` is refused (None: it is not)."""
    if length is None or not length.isdigit():
        return "a JSON body with Content-Length is required"
    if int(length) > MAX_BODY_BYTES:
        return f"body over {MAX_BODY_BYTES} bytes"
    return None


def _reply(answer: Answer) -> Reply:
    """An answer as a hot route's reply: JSON as Starlette's JSONResponse renders it."""
    status, payload, headers = answer
    body = json.dumps(
        payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()
    return status, body, [(k.lower().encode("latin-1"), v.encode("latin-1"))
                          for k, v in headers.items()]  # fmt: skip


def _block_json(b: Any) -> dict[str, Any]:
    d = asdict(b)
    d["block_hash"] = b.block_hash.hex()
    d["parent_hash"] = b.parent_hash.hex() if b.parent_hash is not None else None
    for key in ("first_seen", "last_seen"):
        d[key] = d[key].isoformat()
    for holder in d["holders"]:
        holder["since"] = holder["since"].isoformat()
    return d
