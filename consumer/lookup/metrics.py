"""The lookup service's metrics (exported with the consumer's, on one registry)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kvledger.consumer.metrics import REGISTRY

REQUESTS = Counter(
    "kvledger_http_requests_total",
    "Lookup requests by route and status",
    ["route", "status"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "kvledger_http_seconds", "Lookup request latency by route", ["route"], registry=REGISTRY
)
