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

Every route is an entry of the route table (:mod:`.table`), served through one door
(:mod:`.door`: one gate for tokens, rates and body bounds); this module assembles them.

SQL mode: every request runs in a read-only transaction, and the service refuses to start
with a role that can write to the index (log in as a member of kvledger_reader: `kvledger
roles create-reader`) unless told ``allow_writer``. Memory mode (``router=``, `kvledger serve
--memory`): /v1/match is answered by a RouterIndex; as-of lookups and block rows need the
SQL-backed service (400).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from kvledger import __version__
from kvledger.consumer.metrics import REGISTRY as CONSUMER_REGISTRY
from kvledger.serving.lookup.config import ServiceConfig
from kvledger.serving.lookup.door import Door, Gate
from kvledger.serving.lookup.metrics import PROVISIONAL
from kvledger.serving.lookup.metrics import REGISTRY as LOOKUP_REGISTRY
from kvledger.serving.lookup.openapi import document
from kvledger.serving.lookup.ratelimit import RateLimit
from kvledger.serving.lookup.routes import Lookups
from kvledger.serving.lookup.table import Answer, Raw, Route, Table, routes

if TYPE_CHECKING:
    from kvledger.serving.lookup.dynamo import DynamoApi

__all__ = ["DECISIONS_PER_CLIENT_S", "Parts", "ServiceConfig", "create_app"]


class _KvledgerMetrics:
    """A registry's kvledger_* metrics, without the process's (exported once already)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return (m for m in self.registry.collect() if m.name.startswith("kvledger_"))


_CONSUMER_ONLY = _KvledgerMetrics(CONSUMER_REGISTRY)

# Decision reports a second per client address (and as many at once), each client's own.
DECISIONS_PER_CLIENT_S = 2000

# The dashboard's page and scripts: no data in them (that is /v1/dashboard's, behind the
# token), and no script but these files may run on the page.
_UI_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
_UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


class Parts:
    """What the table's handlers answer with: the lookups (the database or the router),
    Dynamo's API where served, and the service's own documents."""

    lookups: Lookups
    document: bytes
    index: bytes

    def __init__(self, lookups: Lookups, dynamo: DynamoApi | None, in_memory: bool) -> None:
        self.lookups = lookups
        self._dynamo = dynamo
        self.in_memory = in_memory
        self.document = b"{}"  # the OpenAPI document, encoded once (create_app sets both)
        self.index = b"{}"  # GET /: what this service is and what it answers

    @property
    def dynamo(self) -> DynamoApi:
        assert self._dynamo is not None, "Dynamo's routes are in the table only with its API"
        return self._dynamo

    def metrics(self) -> Answer:
        """GET /metrics: the service's metrics (from memory, the router's tail's too: it
        counts what it applies as a consumer does)."""
        body = generate_latest(LOOKUP_REGISTRY)
        if self.in_memory:
            body += generate_latest(_CONSUMER_ONLY)
        return 200, Raw(body, CONTENT_TYPE_LATEST), {}

    def ui_file(self, name: str) -> Answer:
        """One of the dashboard's files (a 503 that says why where it is not installed)."""
        from kvledger.serving.lookup.dashboard import UI

        path = UI / name
        try:
            body = path.read_bytes()
        except FileNotFoundError:
            why = (
                f"the dashboard's {name} is not installed here: scripts/vendor-ui "
                "(which make venv runs, given npm) vendors the chart library"
            )
            return 503, {"error": why}, {}
        return 200, Raw(body, _UI_TYPES[path.suffix], _UI_HEADERS), {}


def _encoded(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def create_app(config: ServiceConfig, extra: tuple[Route, ...] = ()) -> Door:
    """The lookup service of ``config`` (:class:`ServiceConfig`) as an ASGI app: its route
    table (:mod:`.table`; ``extra`` routes after it) served through one door. Raises
    :class:`~kvledger.consumer.roles.WriterRoleError` for a database role that can write
    to the index (unless ``config.allow_writer``)."""
    lookups = Lookups(config)
    if config.provisional is not None:
        PROVISIONAL.stores.add(config.provisional)
    dynamo = None
    if config.dynamo_api:
        source = config.dynamo_router or config.router
        if source is None:
            raise ValueError("Dynamo's API is served from memory: it needs a router")
        from kvledger.serving.lookup.dynamo import DynamoApi

        mine = source is config.router  # decisions are the memory mode's
        dynamo = DynamoApi(
            source,
            config.silent_after,
            config.provisional if mine else None,
            config.record_answer if mine else None,
        )
    in_memory = config.router is not None
    parts = Parts(lookups, dynamo, in_memory)
    table = Table((*routes(config.dynamo_api), *extra))
    parts.document = _encoded(document(table.routes))
    parts.index = _encoded(
        {
            "service": "kvledger lookup service",
            "version": __version__,
            "mode": "memory" if in_memory else "sql",
            "dynamo_api": config.dynamo_api,
            "routes": sorted(f"{r.method} {r.path}" for r in table.routes),
            "openapi": "/openapi.json",
        }
    )
    decisions = RateLimit(DECISIONS_PER_CLIENT_S, DECISIONS_PER_CLIENT_S)
    gate = Gate(
        {"read": config.token, "write": config.token},
        {"decisions": (decisions, "decision reports")},
    )
    return Door(table, gate, parts, in_memory, (lookups.open, lookups.close))
