"""Every metric the consumer exports, defined in one place with its meaning."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvledger.consumer.core.model import Plan

REGISTRY = CollectorRegistry(auto_describe=True)

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
SEQUENCE_GAPS = Counter(
    "kvledger_sequence_gaps_total",
    "Gaps in a source's per-group sequence numbers",
    registry=REGISTRY,
)
BATCH_SECONDS = Histogram(
    "kvledger_batch_seconds",
    "Time to decode, validate and apply one batch (one transaction)",
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
LAG = Gauge(
    "kvledger_partition_lag",
    "Messages between the stored offset and the partition's end offset",
    ["partition"],
    registry=REGISTRY,
)


def record_batch(plan: Plan, seconds: float) -> None:
    """Count one applied batch (its plan) and its duration."""
    BATCH_SECONDS.observe(seconds)
    MESSAGES_APPLIED.inc(plan.applied)
    MESSAGES_DUPLICATE.inc(plan.duplicates)
    BLOCK_EVENTS.inc(plan.block_events)
    NOOP_REMOVALS.inc(plan.noop_removals)
    SEQUENCE_GAPS.inc(plan.gaps)
    for r in plan.rejected:
        MESSAGES_REJECTED.labels(r.reason).inc()
