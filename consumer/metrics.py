"""Every metric the consumer exports, defined in one place with its meaning."""

from __future__ import annotations

import functools
from collections.abc import Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvledger.consumer.core.model import Plan


# Names follow Prometheus' conventions: counters end in _total, durations are _seconds,
# sizes in base units. The registry also carries the process's own metrics (CPU, memory,
# open files, GC), as the default registry would.
def process_registry() -> CollectorRegistry:
    """A registry that already carries the process's own metrics, and which parts of the
    compiled core it runs."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR, _CompiledCore()):
        registry.register(collector)
    return registry


class _CompiledCore(Collector):
    """kvledger_compiled_core{part}: 1 where the compiled core (rust/) runs that part of the
    process, 0 where it does not (the Avro codec is then fastavro's; the router index, the
    core's alone, cannot run): as `kvledger --version` says."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvledger_compiled_core",
            "1 where the compiled core runs this part, 0 where it does not (the Avro codec: "
            "fastavro's then; the router index: missing)",
            labels=["part"],
        )
        for part, compiled in _parts().items():
            family.add_metric([part], float(compiled))
        yield family


@functools.cache
def _parts() -> dict[str, bool]:
    from kvledger.schemas.codec import compiled_parts

    return compiled_parts()


REGISTRY = process_registry()

MESSAGES_APPLIED = Counter(
    "kvledger_messages_applied_total", "Messages applied to the index", registry=REGISTRY
)
MESSAGES_REJECTED = Counter(
    "kvledger_messages_rejected_total",
    "Messages rejected (stored and sent to the dead-letter topic), by reason",
    ["reason"],
    registry=REGISTRY,
)
MESSAGES_DUPLICATE = Counter(
    "kvledger_messages_duplicate_total",
    "Messages skipped as re-deliveries of an already applied (source, group, epoch, seq)",
    registry=REGISTRY,
)
BLOCK_EVENTS = Counter(
    "kvledger_block_events_total", "Block hashes stored or removed in the index", registry=REGISTRY
)
NOOP_REMOVALS = Counter(
    "kvledger_noop_removals_total",
    "Removals of a hash the holder had no reference to (recorded no-ops)",
    registry=REGISTRY,
)
REPORTED_REUSE = Counter(
    "kvledger_reported_reuse_total",
    "Stored blocks a source that reports reuse (GroupSpec.reports_reuse) already held: "
    "reports, no second copy",
    registry=REGISTRY,
)
SEQUENCE_GAPS = Counter(
    "kvledger_sequence_gaps_total",
    "Gaps in a source's per-group sequence numbers",
    registry=REGISTRY,
)
BATCH_SECONDS = Histogram(
    "kvledger_batch_duration_seconds",
    "Time to decode, validate and apply one batch (one transaction)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
FENCED = Counter(
    "kvledger_fenced_batches_total",
    "Batches abandoned because another consumer had advanced a partition",
    registry=REGISTRY,
)
ISOLATED = Counter(
    "kvledger_isolated_messages_total",
    "Messages rejected as apply_error: applying them failed on their own (found by splitting "
    "a failing batch)",
    registry=REGISTRY,
)
SPLITS = Counter(
    "kvledger_batch_splits_total",
    "Failing batches split in two to isolate the message that fails",
    registry=REGISTRY,
)
RETRIES = Counter(
    "kvledger_batch_retries_total", "Batches retried after a database error", registry=REGISTRY
)
NEW_BLOCK_CONFLICTS = Counter(
    "kvledger_new_block_conflicts_total",
    "Batches whose new block rows met rows another consumer stored after this one planned "
    "them: merged by the rules instead of copied (more work, the same index)",
    registry=REGISTRY,
)
RECORDS_LOST = Counter(
    "kvledger_log_records_lost_total",
    "Records the log deleted (retention) before this index read them: the consumer's stored "
    "offset was below the partition's start, so what they said is missing from the index",
    ["topic", "partition"],
    registry=REGISTRY,
)
LAG = Gauge(
    "kvledger_consumer_lag_messages",
    "Messages between the stored offset and the end offset of each partition assigned to "
    "this consumer (only its own: summed over a group's consumers, each partition counts once)",
    ["topic", "partition"],
    registry=REGISTRY,
)


RETENTION_PASSES = Counter(
    "kvledger_retention_passes_total",
    "Retention passes, by outcome (skipped: a table was busy, its drops wait for the next)",
    ["outcome"],
    registry=REGISTRY,
)
PARTITIONS_DROPPED = Counter(
    "kvledger_partitions_dropped_total",
    "Time partitions retention dropped, by table",
    ["table"],
    registry=REGISTRY,
)
BLOCKS_EXPIRED = Counter(
    "kvledger_blocks_expired_total",
    "Block rows deleted: held by no one and named by no retained history",
    registry=REGISTRY,
)
ROUTER_BLOCKS_EXPIRED = Counter(
    "kvledger_router_blocks_expired_total",
    "Blocks an in-memory router forgot: held by no one, no block's parent, past the block "
    "retention",
    registry=REGISTRY,
)
REPUBLISH_BATCHES = Counter(
    "kvledger_republish_batches_total",
    "Batches `kvledger republish` sent on vLLM's wire (each source's, and a snapshot's each)",
    registry=REGISTRY,
)
REPUBLISH_SNAPSHOTS = Counter(
    "kvledger_republish_snapshots_total",
    "Snapshots republished: a source's holdings restated (start-up, a subscriber joining, "
    "a replay older than retained, a source live again)",
    registry=REGISTRY,
)
REPUBLISH_REPLAYS = Counter(
    "kvledger_republish_replays_total",
    "Replay requests by outcome: answered, cut (the subscriber could not take the answer), "
    "malformed (not [empty, 8-byte seq]: no answer, as vLLM)",
    ["outcome"],
    registry=REGISTRY,
)
# A PUB drops a slow subscriber's batches past its high-water mark without telling the
# sender; the subscriber sees the gap in the sequence numbers and asks replay.
REPUBLISH_RESENT = Counter(
    "kvledger_republish_resent_batches_total",
    "Retained batches sent again on replay, per source: what subscribers missed (past a "
    "PUB's high-water mark) and asked for. Snapshots not counted",
    ["source"],
    registry=REGISTRY,
)
RETAINED_SINCE = Gauge(
    "kvledger_retained_since_seconds",
    "Unix time where each table's retained rows start (absent: never trimmed)",
    ["table"],
    registry=REGISTRY,
)


def record_batch(plan: Plan, seconds: float) -> None:
    """Count one applied batch (its plan) and its duration."""
    BATCH_SECONDS.observe(seconds)
    MESSAGES_APPLIED.inc(plan.applied)
    MESSAGES_DUPLICATE.inc(plan.duplicates)
    BLOCK_EVENTS.inc(plan.block_events)
    NOOP_REMOVALS.inc(plan.noop_removals)
    REPORTED_REUSE.inc(plan.reported_reuse)
    SEQUENCE_GAPS.inc(plan.gaps)
    for r in plan.rejected:
        MESSAGES_REJECTED.labels(r.reason).inc()
