"""The lookup service's metrics, on a registry of their own: the SQL-backed service
exports these and the process's; from memory (`serve --memory`) the router applies the log
through the consumer's pipeline, so its /metrics adds the consumer's counters too."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kvledger.consumer.metrics import process_registry

REGISTRY = process_registry()

REQUESTS = Counter(
    "kvledger_http_requests_total",
    "Lookup requests by route and status",
    ["route", "status"],
    registry=REGISTRY,
)
# Lookups take tens of microseconds from memory and under a millisecond from SQL: the
# buckets start at 50 µs.
LATENCY = Histogram(
    "kvledger_http_request_duration_seconds",
    "Lookup request latency by route",
    ["route"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
             0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)  # fmt: skip
