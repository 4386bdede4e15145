"""Every metric the relay exports (per source stream), in one registry of its own."""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
)


class RelayMetrics:
    """The relay's metrics; one instance per process (its own registry, served on
    ``--metrics-port``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:  # the process's own metrics too, as the default registry has
            registry = CollectorRegistry(auto_describe=True)
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = registry
        r = self.registry
        self.batches_received = Counter(
            "kvledger_relay_batches_received_total",
            "Engine batches received (live and replayed, duplicates included)",
            ["source"],
            registry=r,
        )
        self.events_relayed = Counter(
            "kvledger_relay_events_relayed_total",
            "Kafka messages produced from engine events",
            ["source"],
            registry=r,
        )
        self.gaps = Counter(
            "kvledger_relay_gaps_total",
            "Gaps in the engine's batch numbers (each answered by a replay request)",
            ["source"],
            registry=r,
        )
        self.replays = Counter(
            "kvledger_relay_replays_total",
            "Replay requests sent to the engine (start-up, gaps, idle probes, after an abort)",
            ["source"],
            registry=r,
        )
        self.unrecoverable = Counter(
            "kvledger_relay_unrecoverable_gaps_total",
            "Gaps the engine could no longer replay (published as EventsLost)",
            ["source"],
            registry=r,
        )
        self.lost_batches = Counter(
            "kvledger_relay_lost_batches_total",
            "Engine batches lost in unrecoverable gaps",
            ["source"],
            registry=r,
        )
        self.poll_errors = Counter(
            "kvledger_relay_poll_errors_total",
            "Failed polls of a TensorRT-LLM engine's HTTP endpoint (retried with back-off)",
            ["source"],
            registry=r,
        )
        self.undecodable = Counter(
            "kvledger_relay_undecodable_batches_total",
            "Engine batches that did not decode (recorded as lost)",
            ["source"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "kvledger_relay_engine_restarts_total",
            "Engine restarts seen (batch numbers going back): each starts a new epoch",
            ["source"],
            registry=r,
        )
        self.unhealthy = Counter(
            "kvledger_relay_engine_unhealthy_total",
            "Times the engine's --health-url did not answer 200 where the relay would have "
            "said the engine is there (start-up, an idle probe): it stayed silent instead",
            ["source"],
            registry=r,
        )
        self.load_errors = Counter(
            "kvledger_relay_load_errors_total",
            "Failed reads of the engine's --metrics-url (its heartbeats then carry no load)",
            ["source"],
            registry=r,
        )
        self.behind = Gauge(
            "kvledger_relay_behind_seconds",
            "Seconds between the engine's time of the last batch relayed and its relaying",
            ["source"],
            registry=r,
        )
        self.kafka_paused = Gauge(
            "kvledger_relay_kafka_paused",
            "1 while Kafka does not take the relay's writes (the relay is not reading)",
            ["source"],
            registry=r,
        )

    def start(self, source: str) -> None:
        """Every series of ``source`` at zero, so that dashboards see them before any event."""
        for metric in (
            self.batches_received,
            self.events_relayed,
            self.gaps,
            self.replays,
            self.unrecoverable,
            self.lost_batches,
            self.undecodable,
            self.engine_restarts,
            self.unhealthy,
            self.load_errors,
            self.behind,
            self.kafka_paused,
        ):
            metric.labels(source)


class StreamTally:
    """One stream's per-batch counts, reported to its series at each commit or idle moment
    (a metric's update costs more than a batch's bookkeeping)."""

    def __init__(self, metrics: RelayMetrics, source: str) -> None:
        self._received = metrics.batches_received.labels(source)
        self._relayed = metrics.events_relayed.labels(source)
        self._behind = metrics.behind.labels(source)
        self.received = 0  # batches received since the last report
        self.relayed = 0  # events relayed since the last report
        self.behind_s: float | None = None  # how far behind the engine the last one was

    def report(self) -> None:
        if self.received:
            self._received.inc(self.received)
        if self.relayed:
            self._relayed.inc(self.relayed)
        if self.behind_s is not None:
            self._behind.set(self.behind_s)
        self.received = self.relayed = 0
        self.behind_s = None
