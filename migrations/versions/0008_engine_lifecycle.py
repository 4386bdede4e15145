"""Engines' lives: restarts end what died with the process, silent and closed sources leave
routing answers, and both are on record.

- source_health.surviving_media: what a source said outlives its restart (NULL: default).
- kvledger.sources: one row per source: epoch, last seen (log time of its latest message),
  closed_at (a goodbye), heartbeat interval, restarts.
- kvledger.lifecycle_events: each restart (per stream) and goodbye, with the residencies it
  ended per tier; views kvledger.restarts and kvledger.source_status.
- residency_history.removed_by also takes 'restart' and 'closed'.
- kvledger.source_state(source, silent_after): live | silent | closed | unknown, against the
  server's clock; the window defaults to the setting kvledger.silent_after, else 30 s.
- The lookups that answer "now" leave out holders whose source is not live unless asked:
  match_prefix and match_tokens keep their arguments, add p_include_silent and
  p_silent_after, and return each holder's source_state. The unfiltered functions they wrap
  are held_prefix and held_tokens (the previous match_prefix and match_tokens). As-of
  lookups (match_prefix_at) are unchanged.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_UPGRADE = r"""
ALTER TABLE kvledger.residency_history DROP CONSTRAINT residency_history_removed_by_check;
ALTER TABLE kvledger.residency_history ADD CONSTRAINT residency_history_removed_by_check
    CHECK (removed_by IN ('removed', 'cleared', 'restart', 'closed'));
ALTER TABLE kvledger.source_health ADD COLUMN surviving_media text[];

CREATE TABLE kvledger.sources (
    source       text        PRIMARY KEY,
    model        text        NOT NULL,
    epoch        bigint      NOT NULL,
    last_seen    timestamptz NOT NULL,
    closed_at    timestamptz,
    heartbeat_ms bigint,
    restarts     bigint      NOT NULL DEFAULT 0
);
INSERT INTO kvledger.sources (source, model, epoch, last_seen, restarts)
SELECT source, min(model), max(epoch), coalesce(max(last_event_time), now()),
       max(epoch_changes)
FROM kvledger.source_health GROUP BY source;

CREATE TABLE kvledger.lifecycle_events (
    id              bigserial   PRIMARY KEY,
    source          text        NOT NULL,
    model           text        NOT NULL,
    group_idx       integer,
    kind            text        NOT NULL CHECK (kind IN ('restart', 'closed')),
    epoch           bigint      NOT NULL,
    previous_epoch  bigint,
    event_time      timestamptz NOT NULL,
    kafka_topic     text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    ended_gpu       integer     NOT NULL DEFAULT 0,
    ended_cpu       integer     NOT NULL DEFAULT 0,
    ended_storage   integer     NOT NULL DEFAULT 0
);
CREATE INDEX lifecycle_events_source_idx ON kvledger.lifecycle_events (source, event_time);

CREATE FUNCTION kvledger.silent_after() RETURNS interval
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('kvledger.silent_after', true), '')::interval,
                    interval '30 seconds')
$$;

CREATE FUNCTION kvledger.source_state(p_source text, p_silent_after interval DEFAULT NULL)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT CASE
                    WHEN s.closed_at IS NOT NULL THEN 'closed'
                    WHEN s.last_seen < now() - coalesce(p_silent_after, kvledger.silent_after())
                        THEN 'silent'
                    ELSE 'live'
                END
         FROM kvledger.sources s WHERE s.source = p_source),
        'unknown')
$$;

ALTER FUNCTION kvledger.match_prefix(text, integer, bytea[], text) RENAME TO held_prefix;
ALTER FUNCTION kvledger.match_tokens(text, integer, integer[], text) RENAME TO held_tokens;
CREATE OR REPLACE FUNCTION kvledger.held_tokens(p_model text, p_group integer, p_tokens integer[], p_lora text DEFAULT NULL::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint)
 LANGUAGE sql
 STABLE
AS $function$
            WITH RECURSIVE spec AS (
                SELECT block_size, hash_block_size FROM kvledger.group_specs
                WHERE model = p_model AND group_idx = p_group
            ),
            chain(h, i) AS (
                SELECT b.block_hash, 1
                FROM kvledger.blocks b, spec
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash IS NULL
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND b.token_ids = p_tokens[1:spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, c.i + 1
                FROM chain c, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = c.h
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND (c.i + 1) * spec.block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[c.i * spec.block_size + 1:(c.i + 1) * spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
            ),
            tip AS (
                SELECT (SELECT h FROM chain ORDER BY i DESC LIMIT 1) AS h,
                       (SELECT count(*) FROM chain)::integer * spec.block_size AS pos
                FROM spec
            ),
            tail(h, j, pos) AS (
                SELECT b.block_hash, 1, tip.pos + spec.hash_block_size
                FROM tip, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group
                  AND b.parent_hash IS NOT DISTINCT FROM tip.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND tip.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[tip.pos + 1:tip.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, t.j + 1, t.pos + spec.hash_block_size
                FROM tail t, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = t.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND t.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[t.pos + 1:t.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
            )
            SELECT m.instance, m.medium, m.ownership,
                   least(m.matched_blocks, (SELECT count(*) FROM chain))::integer,
                   m.matched_tokens
            FROM kvledger.held_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h)) m

        $function$;

CREATE FUNCTION kvledger.match_prefix(p_model text, p_group integer, p_hashes bytea[],
                                      p_granularity text DEFAULT 'block',
                                      p_include_silent boolean DEFAULT false,
                                      p_silent_after interval DEFAULT NULL)
RETURNS TABLE (instance text, medium text, ownership text, matched_blocks integer,
               matched_tokens bigint, source_state text)
LANGUAGE sql STABLE AS $$
    SELECT h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens, s.state
    FROM kvledger.held_prefix(p_model, p_group, p_hashes, p_granularity) h
    CROSS JOIN LATERAL (SELECT kvledger.source_state(h.instance, p_silent_after) AS state) s
    WHERE p_include_silent OR s.state = 'live'
$$;

CREATE FUNCTION kvledger.match_tokens(p_model text, p_group integer, p_tokens integer[],
                                      p_lora text DEFAULT NULL,
                                      p_include_silent boolean DEFAULT false,
                                      p_silent_after interval DEFAULT NULL)
RETURNS TABLE (instance text, medium text, ownership text, matched_blocks integer,
               matched_tokens bigint, source_state text)
LANGUAGE sql STABLE AS $$
    SELECT h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens, s.state
    FROM kvledger.held_tokens(p_model, p_group, p_tokens, p_lora) h
    CROSS JOIN LATERAL (SELECT kvledger.source_state(h.instance, p_silent_after) AS state) s
    WHERE p_include_silent OR s.state = 'live'
$$;

CREATE VIEW kvledger.restarts AS
SELECT source, model, epoch, previous_epoch, min(event_time) AS restarted_at,
       sum(ended_gpu)::bigint AS ended_gpu, sum(ended_cpu)::bigint AS ended_cpu,
       sum(ended_storage)::bigint AS ended_storage, count(*) AS streams
FROM kvledger.lifecycle_events WHERE kind = 'restart'
GROUP BY source, model, epoch, previous_epoch;

CREATE VIEW kvledger.source_status AS
SELECT s.source, s.model, kvledger.source_state(s.source) AS state, s.epoch, s.last_seen,
       s.closed_at, s.heartbeat_ms, s.restarts,
       (SELECT max(l.event_time) FROM kvledger.lifecycle_events l
         WHERE l.source = s.source AND l.kind = 'restart') AS last_restart,
       coalesce((SELECT sum(h.gap_count) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS gaps,
       coalesce((SELECT sum(h.missing_events) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS missing_events,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'GPU') AS held_gpu,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'CPU') AS held_cpu,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'STORAGE') AS held_storage
FROM kvledger.sources s;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
        GRANT SELECT ON ALL TABLES IN SCHEMA kvledger TO kvledger_reader;
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA kvledger TO kvledger_reader;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'kvledger_reader not granted: %', SQLERRM;
END
$$;
"""

_DOWNGRADE = r"""
DROP VIEW kvledger.source_status;
DROP VIEW kvledger.restarts;
DROP FUNCTION kvledger.match_tokens(text, integer, integer[], text, boolean, interval);
DROP FUNCTION kvledger.match_prefix(text, integer, bytea[], text, boolean, interval);
ALTER FUNCTION kvledger.held_prefix(text, integer, bytea[], text) RENAME TO match_prefix;
ALTER FUNCTION kvledger.held_tokens(text, integer, integer[], text) RENAME TO match_tokens;
CREATE OR REPLACE FUNCTION kvledger.match_tokens(p_model text, p_group integer, p_tokens integer[], p_lora text DEFAULT NULL::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint)
 LANGUAGE sql
 STABLE
AS $function$
            WITH RECURSIVE spec AS (
                SELECT block_size, hash_block_size FROM kvledger.group_specs
                WHERE model = p_model AND group_idx = p_group
            ),
            chain(h, i) AS (
                SELECT b.block_hash, 1
                FROM kvledger.blocks b, spec
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash IS NULL
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND b.token_ids = p_tokens[1:spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, c.i + 1
                FROM chain c, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = c.h
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND (c.i + 1) * spec.block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[c.i * spec.block_size + 1:(c.i + 1) * spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
            ),
            tip AS (
                SELECT (SELECT h FROM chain ORDER BY i DESC LIMIT 1) AS h,
                       (SELECT count(*) FROM chain)::integer * spec.block_size AS pos
                FROM spec
            ),
            tail(h, j, pos) AS (
                SELECT b.block_hash, 1, tip.pos + spec.hash_block_size
                FROM tip, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group
                  AND b.parent_hash IS NOT DISTINCT FROM tip.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND tip.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[tip.pos + 1:tip.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, t.j + 1, t.pos + spec.hash_block_size
                FROM tail t, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = t.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND t.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[t.pos + 1:t.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
            )
            SELECT m.instance, m.medium, m.ownership,
                   least(m.matched_blocks, (SELECT count(*) FROM chain))::integer,
                   m.matched_tokens
            FROM kvledger.match_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h)) m

        $function$;
DROP FUNCTION kvledger.source_state(text, interval);
DROP FUNCTION kvledger.silent_after();
DROP TABLE kvledger.lifecycle_events;
DROP TABLE kvledger.sources;
ALTER TABLE kvledger.source_health DROP COLUMN surviving_media;
UPDATE kvledger.residency_history SET removed_by = 'cleared'
    WHERE removed_by IN ('restart', 'closed');
ALTER TABLE kvledger.residency_history DROP CONSTRAINT residency_history_removed_by_check;
ALTER TABLE kvledger.residency_history ADD CONSTRAINT residency_history_removed_by_check
    CHECK (removed_by IN ('removed', 'cleared'));
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
