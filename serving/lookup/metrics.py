"""The lookup service's metrics, on a registry of their own: the SQL-backed service
exports these and the process's; from memory (`serve --memory`) the router applies the log
through the consumer's pipeline, so its /metrics adds the consumer's counters too."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

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
    buckets=(
        0.00005,
        0.0001,
        0.00025,
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        5.0,
    ),
    registry=REGISTRY,
)


class _Provisional:
    """kvledger_provisional_* and kvledger_decisions_*: read at scrape time from the
    provisional stores and decision logs alive in the process (one per service)."""

    def __init__(self) -> None:
        self.stores: weakref.WeakSet[Any] = weakref.WeakSet()  # Provisional
        self.logs: weakref.WeakSet[Any] = weakref.WeakSet()  # DecisionLog

    def collect(self) -> Iterator[Metric]:
        stores, logs = list(self.stores), list(self.logs)
        if not stores:
            return
        decisions = CounterMetricFamily(
            "kvledger_provisional_decisions",
            "Routers' decisions held as provisional holders, by how they ended: confirmed "
            "(by the engine's events), expired (the window passed first), evicted (pushed "
            "out by the bound on held blocks)",
            labels=["outcome"],
        )
        for outcome in ("confirmed", "expired", "evicted"):
            decisions.add_metric([outcome], sum(getattr(s.stats, outcome) for s in stores))
        yield decisions
        yield CounterMetricFamily(
            "kvledger_provisional_added",
            "Decisions held (reported here or shared by a replica)",
            value=sum(s.stats.added for s in stores),
        )
        yield GaugeMetricFamily(
            "kvledger_provisional_held", "Decisions held now", value=sum(len(s) for s in stores)
        )
        if logs:
            shared = CounterMetricFamily(
                "kvledger_decisions_records",
                "Records of the decisions topic: shared (another replica's, held here), "
                "rejected (not a decision), unsent (this replica's, the producer's queue full)",
                labels=["outcome"],
            )
            for outcome, name in (
                ("shared", "shared"),
                ("rejected", "rejected"),
                ("unsent", "dropped"),
            ):
                shared.add_metric([outcome], sum(getattr(log, name) for log in logs))
            yield shared


# Decisions recorded (POST /v1/decisions with --decisions-topic): blocks of each kind, and
# per decision the fraction of the available reuse the router captured.
DECISION_BLOCKS = Counter(
    "kvledger_decision_blocks",
    "Blocks of the prompts routers reported decisions for: prompt, available (the most any "
    "live holder had), captured (what the chosen instance had)",
    ["kind"],
    registry=REGISTRY,
)
CAPTURED_FRACTION = Histogram(
    "kvledger_decision_captured_fraction",
    "Per decision with reuse available, captured blocks over available blocks",
    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
    registry=REGISTRY,
)

PROVISIONAL = _Provisional()
REGISTRY.register(PROVISIONAL)
