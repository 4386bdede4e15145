"""Dynamo's KV-indexer routes on the lookup service (:mod:`.dynamo` answers them): Starlette
routes for each path, and POST /query and /query_by_hash as hot routes (lookup/hot.py), as
the service's /v1/match from memory is."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvledger.serving.lookup.dynamo import Answer, DynamoApi
from kvledger.serving.lookup.dynamo_requests import MAX_BODY_BYTES, DynamoRequestError
from kvledger.serving.lookup.hot import HotRoute, Reply
from kvledger.serving.lookup.metrics import LATENCY, REQUESTS

logger = logging.getLogger(__name__)


def routes(api: DynamoApi, refusal: Callable[[Request], Answer | None]) -> list[Route]:
    """Starlette routes for Dynamo's paths; ``refusal(request)``: the service's answer to a
    request it refuses before reading it (a missing bearer token), else None."""

    def handler(name: str, fn: Callable[[Request, bytes], Answer], slow: bool = False) -> Any:
        async def handle(request: Request) -> Response:
            start = time.perf_counter()
            result = refusal(request)
            raw = b""
            if result is None and request.method == "POST":
                result = length_refusal(request.headers.get("content-length"))
                if result is None:
                    raw = await request.body()
            if result is None:
                result = await run_in_threadpool(_answer, name, fn, request, raw) if slow else (
                    _answer(name, fn, request, raw)
                )  # fmt: skip
            LATENCY.labels(name).observe(time.perf_counter() - start)
            REQUESTS.labels(name, str(result[0])).inc()
            if isinstance(result[1], bytes):  # JSON already
                return Response(result[1], result[0], media_type="application/json")
            return JSONResponse(result[1], result[0])

        return handle

    def workers(request: Request, _: bytes) -> Answer:
        q = request.query_params
        return api.list_workers(q.get("model_name"), q.get("routing_group"))

    return [
        Route("/query", handler("dynamo_query", lambda _, b: api.query(b, False)),
              methods=["POST"]),
        Route("/query_by_hash", handler("dynamo_query_by_hash", lambda _, b: api.query(b, True)),
              methods=["POST"]),
        Route("/dump", handler("dynamo_dump", lambda _, b: api.dump(), slow=True),
              methods=["GET"]),
        Route("/workers", handler("dynamo_workers", workers, slow=True), methods=["GET"]),
        Route("/register", handler("dynamo_register", lambda _, b: api.register(b)),
              methods=["POST"]),
        Route("/unregister", handler("dynamo_unregister", lambda _, b: api.unregister(b)),
              methods=["POST"]),
        Route("/health", lambda _: Response(status_code=200), methods=["GET"]),
    ]  # fmt: skip


def length_refusal(length: str | None) -> Answer | None:
    """Dynamo's answer to a POST body of Content-Length ``length`` it does not read (None:
    it reads it)."""
    if length is None or not (length.isascii() and length.isdigit()):
        return 411, {"error": "a JSON body with Content-Length is required"}
    if int(length) > MAX_BODY_BYTES:
        return 413, {"error": f"body over {MAX_BODY_BYTES} bytes"}
    return None


def hot_routes(api: DynamoApi, allowed: Callable[[str], bool]) -> dict[str, HotRoute]:
    """POST /query and /query_by_hash as hot routes (lookup/hot.py: Starlette's and the
    ASGI server's per-request layers cost more than the lookup). Same checks, answers and
    metrics as :func:`routes`; ``allowed(authorization)``: the bearer check."""

    def hot(name: str, by_hash: bool) -> HotRoute:
        latency = LATENCY.labels(name)  # the metrics' children, found once
        requests: dict[int, Any] = {}

        def done(started: float, result: Answer) -> Reply:
            latency.observe(time.perf_counter() - started)
            counter = requests.get(result[0])
            if counter is None:
                counter = requests[result[0]] = REQUESTS.labels(name, str(result[0]))
            counter.inc()
            body = result[1]  # JSON already, or compact JSON as json.dumps(...) writes it
            if not isinstance(body, bytes):
                body = msgspec.json.encode(body)
            return result[0], body, [(b"www-authenticate", b"Bearer")] if result[0] == 401 else []

        def refusal(authorization: str, length: str | None) -> Reply | None:
            result: Answer | None = (
                (401, {"error": "a bearer token is required"})
                if not allowed(authorization)
                else length_refusal(length)
            )
            return None if result is None else done(time.perf_counter(), result)

        def reply(raw: bytes, started: float) -> Reply:
            return done(started, _answer(name, lambda _, b: api.query(b, by_hash), None, raw))

        return HotRoute(refusal, reply)

    return {
        "/query": hot("dynamo_query", False),
        "/query_by_hash": hot("dynamo_query_by_hash", True),
    }


def _answer(
    name: str, fn: Callable[[Any, bytes], Answer], request: Request | None, raw: bytes
) -> Answer:
    try:
        return fn(request, raw)
    except DynamoRequestError as exc:
        return exc.status, {"error": str(exc)}
    except Exception:  # a bug: answered and counted as a 500, never a dropped request
        logger.exception("Dynamo API %s failed", name)
        return 500, {"error": "internal error"}
