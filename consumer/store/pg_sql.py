"""The PostgreSQL store's SQL: the session's temporary tables and one merge per table.

Each merge states in SQL the rule the tests' in-memory store states in Python
(tests/helpers/memory_store.py), and the conformance suite checks that they agree.
"""

from __future__ import annotations

from kvledger.consumer.store.tables import HISTORY_CLOSE

TEMP_TABLES = f"""
CREATE TEMP TABLE IF NOT EXISTS tmp_blocks (LIKE kvledger.blocks) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS tmp_res (LIKE kvledger.residencies) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS tmp_close (
    {", ".join(f"{name} {kind}" for name, kind in HISTORY_CLOSE)}
) ON COMMIT DELETE ROWS;
"""

RESIDENCY_SELECT = (
    "r.group_idx, r.block_hash, r.refcount, r.locality, r.since, r.kafka_topic, "
    "r.kafka_partition, r.kafka_offset"
)

# Content is replaced exactly where the core's upgrades() says: never by a placeholder
# (block_size 0), and otherwise over a placeholder, a partial tail by a full block, or a row
# of unknown position by one of the same size that knows it; metadata is kept from the
# first writer that has it; seen times widen.
CONTENT_SWAP = (
    "EXCLUDED.block_size > 0 AND (blocks.block_size = 0"
    " OR (blocks.partial AND NOT EXCLUDED.partial)"
    " OR (blocks.token_start IS NULL AND EXCLUDED.token_start IS NOT NULL"
    " AND EXCLUDED.block_size = blocks.block_size AND EXCLUDED.partial = blocks.partial))"
)
MERGE_BLOCKS = f"""
INSERT INTO kvledger.blocks AS blocks
SELECT * FROM tmp_blocks
ON CONFLICT (model, group_idx, block_hash) DO UPDATE SET
    parent_hash = CASE WHEN {CONTENT_SWAP} THEN EXCLUDED.parent_hash ELSE blocks.parent_hash END,
    token_start = CASE WHEN {CONTENT_SWAP} THEN EXCLUDED.token_start ELSE blocks.token_start END,
    token_end = CASE WHEN {CONTENT_SWAP} THEN EXCLUDED.token_end ELSE blocks.token_end END,
    token_ids = CASE WHEN {CONTENT_SWAP} THEN EXCLUDED.token_ids ELSE blocks.token_ids END,
    partial = CASE WHEN {CONTENT_SWAP} THEN EXCLUDED.partial ELSE blocks.partial END,
    block_size = CASE WHEN {CONTENT_SWAP} THEN EXCLUDED.block_size ELSE blocks.block_size END,
    lora_name = COALESCE(blocks.lora_name, EXCLUDED.lora_name),
    extra_keys = COALESCE(blocks.extra_keys, EXCLUDED.extra_keys),
    first_seen = LEAST(blocks.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(blocks.last_seen, EXCLUDED.last_seen)
"""

# Closing an interval moves it from the open partition into the time partition of now (the
# partition key is coalesce(closed_at, 'infinity'): the last line keeps the scan on the open
# partition).
CLOSE_HISTORY = """
UPDATE kvledger.residency_history h
SET removed_at = GREATEST(c.removed_at, h.stored_at), removed_by = c.removed_by,
    closed_at = now()
FROM tmp_close c
WHERE h.model = c.model AND h.group_idx = c.group_idx AND h.block_hash = c.block_hash
  AND h.instance = c.instance AND h.medium = c.medium AND h.ownership = c.ownership
  AND h.removed_at IS NULL AND coalesce(h.closed_at, 'infinity'::timestamptz) = 'infinity'
"""

MERGE_RESIDENCIES = """
DELETE FROM kvledger.residencies r USING tmp_res t
WHERE t.refcount = 0 AND r.model = t.model AND r.group_idx = t.group_idx
  AND r.block_hash = t.block_hash AND r.instance = t.instance AND r.medium = t.medium
  AND r.ownership = t.ownership;
INSERT INTO kvledger.residencies AS r (model, group_idx, block_hash, instance, medium,
    ownership, locality, since, kafka_topic, kafka_partition, kafka_offset, refcount)
SELECT model, group_idx, block_hash, instance, medium, ownership, locality, since,
    kafka_topic, kafka_partition, kafka_offset, refcount
FROM tmp_res WHERE refcount > 0
ON CONFLICT (model, group_idx, block_hash, instance, medium, ownership) DO UPDATE SET
    refcount = EXCLUDED.refcount, locality = EXCLUDED.locality, since = EXCLUDED.since,
    kafka_topic = EXCLUDED.kafka_topic, kafka_partition = EXCLUDED.kafka_partition,
    kafka_offset = EXCLUDED.kafka_offset
"""

# A rejection is stored once per message (a replay that rejects it again keeps the first).
INSERT_REJECTED = """
INSERT INTO kvledger.rejected_events (kafka_topic, kafka_partition, kafka_offset, kafka_key,
    raw, reason, detail, source)
SELECT %s, %s, %s, %s, %s, %s, %s, %s
WHERE NOT EXISTS (SELECT 1 FROM kvledger.rejected_events r
                  WHERE r.kafka_topic = %s AND r.kafka_partition = %s AND r.kafka_offset = %s)
"""

UPSERT_SOURCE = """
INSERT INTO kvledger.source_health AS s (source, model, group_idx, epoch, last_seq, gap_count,
    missing_events, epoch_changes, duplicates, last_event_time, surviving_media, lost_gaps,
    lost_batches, reports_reuse)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (source, model, group_idx) DO UPDATE SET
    epoch = EXCLUDED.epoch, last_seq = EXCLUDED.last_seq, gap_count = EXCLUDED.gap_count,
    missing_events = EXCLUDED.missing_events, epoch_changes = EXCLUDED.epoch_changes,
    duplicates = EXCLUDED.duplicates, last_event_time = EXCLUDED.last_event_time,
    surviving_media = EXCLUDED.surviving_media, lost_gaps = EXCLUDED.lost_gaps,
    lost_batches = EXCLUDED.lost_batches, reports_reuse = EXCLUDED.reports_reuse
"""

UPSERT_LIFE = """
INSERT INTO kvledger.sources AS s (source, model, epoch, last_seen, closed_at, heartbeat_ms,
    restarts, previous_model, model_changed_at, requests_running, requests_waiting, load_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (source) DO UPDATE SET
    model = EXCLUDED.model, epoch = EXCLUDED.epoch, last_seen = EXCLUDED.last_seen,
    closed_at = EXCLUDED.closed_at, heartbeat_ms = EXCLUDED.heartbeat_ms,
    restarts = EXCLUDED.restarts, previous_model = EXCLUDED.previous_model,
    model_changed_at = EXCLUDED.model_changed_at, requests_running = EXCLUDED.requests_running,
    requests_waiting = EXCLUDED.requests_waiting, load_at = EXCLUDED.load_at
"""
