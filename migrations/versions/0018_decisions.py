"""Routing decisions as data: what kvledger offered, what a router chose, and what the engine
then reused (issue: explainable hit rates).

- ``kvledger.decisions``: one row per decision a lookup replica recorded (``POST
  /v1/decisions``), read from the decisions topic by the consumer (consumer/decisions.py).
  Time-partitioned by ``recorded_at`` (the database's clock) like the audit log, and dropped
  with it by retention (``drop_partitions``' audit cut-off).
- ``kvledger.rejected_decisions``: records of that topic that are not decisions, with their
  bytes and the reason.
- ``kvledger.decision_outcomes``: each decision with its *delivered* blocks and its outcome.
  Delivered: of the blocks the chosen instance held (captured), those it did not store
  again on its GPU tier within a minute after the decision (a block it stored again had
  been evicted before the request arrived). Known only where the decision carries the
  captured blocks' hashes (``captured_hashes``: at most 8,192); NULL where it does not
  (records of token-keyed decisions written before the lookup service named them).
  Outcome, the first that applies: ``no_holder`` (no live or silent instance held any
  block), ``holder_silent`` (only silent instances did), ``chosen_elsewhere`` (the chosen
  instance held less than the best live one), ``lower_tier_only`` (it held as much, on a
  tier below the GPU), ``evicted_before_arrival`` (delivered < captured), ``captured``.
- ``kvledger.decision_funnel``: per minute, model and chosen instance, the sums of prompt,
  available, captured and delivered blocks and the count of each outcome.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_TABLES = r"""
CREATE TABLE kvledger.decisions (
    decision_id      uuid        NOT NULL,
    recorded_at      timestamptz NOT NULL DEFAULT now(),
    decided_at       timestamptz NOT NULL,
    model            text        NOT NULL,
    group_idx        integer     NOT NULL,
    request_id       text,
    origin           text        NOT NULL,
    chosen           text        NOT NULL,
    chosen_state     text        NOT NULL,
    block_size       integer     NOT NULL CHECK (block_size > 0),
    prompt_blocks    integer     NOT NULL CHECK (prompt_blocks >= 0),
    first_hash       bytea,
    last_hash        bytea,
    captured_hashes    bytea[],
    available_blocks integer     NOT NULL CHECK (available_blocks >= 0),
    available_tier   text,
    captured_blocks  integer     NOT NULL CHECK (captured_blocks >= 0),
    captured_tier    text,
    silent_blocks    integer     NOT NULL DEFAULT 0 CHECK (silent_blocks >= 0),
    offered          jsonb       NOT NULL,
    kafka_topic      text        NOT NULL,
    kafka_partition  integer     NOT NULL,
    kafka_offset     bigint      NOT NULL,
    PRIMARY KEY (decision_id, recorded_at)
) PARTITION BY RANGE (recorded_at);
CREATE TABLE kvledger.decisions_default PARTITION OF kvledger.decisions DEFAULT;
-- Records of the decisions topic that are not decisions: kept with their bytes and why.
CREATE TABLE kvledger.rejected_decisions (
    kafka_topic     text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    raw             bytea       NOT NULL,
    reason          text        NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kafka_topic, kafka_partition, kafka_offset)
);
CREATE INDEX decisions_decided_idx ON kvledger.decisions (decided_at);
CREATE INDEX decisions_chosen_idx ON kvledger.decisions (model, chosen, decided_at);

CREATE VIEW kvledger.decision_outcomes AS
SELECT d.decision_id, d.decided_at, d.recorded_at, d.model, d.group_idx, d.request_id,
       d.origin, d.chosen, d.chosen_state, d.block_size, d.prompt_blocks,
       d.available_blocks, d.available_tier, d.captured_blocks, d.captured_tier,
       d.silent_blocks, del.delivered_blocks,
       CASE
           WHEN d.available_blocks = 0 AND d.silent_blocks = 0 THEN 'no_holder'
           WHEN d.available_blocks = 0 THEN 'holder_silent'
           WHEN d.captured_blocks < d.available_blocks THEN 'chosen_elsewhere'
           WHEN d.captured_tier IS DISTINCT FROM 'GPU' THEN 'lower_tier_only'
           WHEN del.delivered_blocks < d.captured_blocks THEN 'evicted_before_arrival'
           ELSE 'captured'
       END AS outcome,
       d.offered
FROM kvledger.decisions d
CROSS JOIN LATERAL (
    SELECT CASE WHEN d.captured_hashes IS NULL THEN NULL ELSE coalesce((
        SELECT min(array_position(d.captured_hashes, h.block_hash)) - 1
        FROM kvledger.residency_history h
        WHERE h.model = d.model AND h.group_idx = d.group_idx AND h.instance = d.chosen
          AND h.medium = 'GPU' AND h.ownership = ''
          AND h.block_hash = ANY (d.captured_hashes)
          AND h.stored_at > d.decided_at
          AND h.stored_at <= d.decided_at + interval '1 minute'
    ), d.captured_blocks) END AS delivered_blocks
) del;

CREATE VIEW kvledger.decision_funnel AS
SELECT date_trunc('minute', decided_at) AS minute, model, chosen AS instance,
       count(*) AS decisions,
       sum(prompt_blocks) AS prompt_blocks,
       sum(available_blocks) AS available_blocks,
       sum(captured_blocks) AS captured_blocks,
       sum(delivered_blocks) AS delivered_blocks,
       count(delivered_blocks) AS delivered_known,
       count(*) FILTER (WHERE outcome = 'no_holder') AS no_holder,
       count(*) FILTER (WHERE outcome = 'holder_silent') AS holder_silent,
       count(*) FILTER (WHERE outcome = 'chosen_elsewhere') AS chosen_elsewhere,
       count(*) FILTER (WHERE outcome = 'lower_tier_only') AS lower_tier_only,
       count(*) FILTER (WHERE outcome = 'evicted_before_arrival') AS evicted_before_arrival,
       count(*) FILTER (WHERE outcome = 'captured') AS captured
FROM kvledger.decision_outcomes
GROUP BY 1, 2, 3;
"""

# The partition functions of 0014, with decisions among the partitioned tables.
_FUNCTIONS = r"""
-- The partition key of each partitioned table, as an expression over its columns.
CREATE OR REPLACE FUNCTION kvledger.partition_key(p_parent text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE p_parent
        WHEN 'residency_history' THEN 'coalesce(closed_at, ''infinity''::timestamptz)'
        WHEN 'events' THEN 'applied_at'
        WHEN 'rejected_events' THEN 'first_seen'
        WHEN 'decisions' THEN 'recorded_at'
    END
$$;

-- Make the partitions that cover [p_from, p_until), continuing from the newest one (or,
-- when there is none or it ended before p_from, from p_from's interval boundary). A row
-- already in the default partition for a new range is moved into it. Returns how many
-- partitions it made.
CREATE OR REPLACE FUNCTION kvledger.ensure_partitions(p_from timestamptz, p_until timestamptz)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_iv interval;
    v_step double precision;
    v_parent text;
    v_key text;
    v_lo timestamptz;
    v_hi timestamptz;
    v_name text;
    v_made integer := 0;
    v_stray boolean;
BEGIN
    -- One maker at a time (every consumer of a group runs passes): a second waits, then
    -- finds the partitions made.
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    SELECT partition_interval INTO STRICT v_iv FROM kvledger.retention_settings;
    v_step := extract(epoch FROM v_iv);
    FOREACH v_parent IN ARRAY ARRAY['residency_history', 'events', 'rejected_events', 'decisions'] LOOP
        v_key := kvledger.partition_key(v_parent);
        v_lo := to_timestamp(floor(extract(epoch FROM p_from) / v_step) * v_step);
        SELECT greatest(v_lo, max(t.hi)) INTO v_lo
          FROM kvledger.time_partitions t WHERE t.parent = v_parent;
        WHILE v_lo < p_until LOOP
            v_hi := v_lo + v_iv;
            v_name := format('%s_p%s', v_parent,
                             to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS'));
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM kvledger.%I WHERE %s >= $1 AND %s < $2)',
                           v_parent || '_default', v_key, v_key)
               INTO v_stray USING v_lo, v_hi;
            IF v_stray THEN
                EXECUTE format('CREATE TEMP TABLE kvledger_stray ON COMMIT DROP AS '
                               'WITH d AS (DELETE FROM kvledger.%I WHERE %s >= $1 AND %s < $2 '
                               'RETURNING *) SELECT * FROM d',
                               v_parent || '_default', v_key, v_key) USING v_lo, v_hi;
            END IF;
            EXECUTE format('CREATE TABLE kvledger.%I PARTITION OF kvledger.%I '
                           'FOR VALUES FROM (%L) TO (%L)', v_name, v_parent, v_lo, v_hi);
            IF v_stray THEN
                EXECUTE format('INSERT INTO kvledger.%I SELECT * FROM kvledger_stray', v_parent);
                DROP TABLE kvledger_stray;
            END IF;
            INSERT INTO kvledger.time_partitions (parent, partition, lo, hi)
            VALUES (v_parent, v_name, v_lo, v_hi);
            v_made := v_made + 1;
            v_lo := v_hi;
        END LOOP;
    END LOOP;
    RETURN v_made;
END
$$;

-- Drop every partition that ended at or before its table's cut-off (history: p_history;
-- events and rejected_events: p_audit), and delete the default partitions' rows before it.
-- Each table's retained window then starts at the newest dropped partition's end.
CREATE OR REPLACE FUNCTION kvledger.drop_partitions(p_history timestamptz, p_audit timestamptz)
RETURNS TABLE (parent text, partition text, lo timestamptz, hi timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_row record;
    v_parent text;
    v_cut timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    FOR v_row IN
        SELECT t.parent, t.partition, t.lo, t.hi FROM kvledger.time_partitions t
        WHERE t.hi <= CASE t.parent WHEN 'residency_history' THEN p_history ELSE p_audit END
        ORDER BY t.parent, t.lo
    LOOP
        EXECUTE format('DROP TABLE kvledger.%I', v_row.partition);
        DELETE FROM kvledger.time_partitions t WHERE t.partition = v_row.partition;
        INSERT INTO kvledger.retained_windows AS w (what, since) VALUES (v_row.parent, v_row.hi)
        ON CONFLICT (what) DO UPDATE SET since = greatest(w.since, EXCLUDED.since),
            updated_at = now();
        parent := v_row.parent; partition := v_row.partition; lo := v_row.lo; hi := v_row.hi;
        RETURN NEXT;
    END LOOP;
    FOREACH v_parent IN ARRAY ARRAY['residency_history', 'events', 'rejected_events', 'decisions'] LOOP
        v_cut := CASE v_parent WHEN 'residency_history' THEN p_history ELSE p_audit END;
        EXECUTE format('DELETE FROM kvledger.%I WHERE %s < $1', v_parent || '_default',
                       kvledger.partition_key(v_parent)) USING v_cut;
    END LOOP;
END
$$;

-- A new partition interval. Each table's newest partitions that hold no row are dropped
-- and made again at the new interval, from now: it applies at once on a new or idle index,
-- else from the end of the newest partition holding rows.
CREATE OR REPLACE FUNCTION kvledger.set_partition_interval(p_interval interval)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_parent text;
    v_row record;
    v_used boolean;
BEGIN
    IF p_interval < interval '1 second' THEN
        RAISE EXCEPTION 'the partition interval must be at least 1 second, not %', p_interval
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    UPDATE kvledger.retention_settings SET partition_interval = p_interval, updated_at = now();
    FOREACH v_parent IN ARRAY ARRAY['residency_history', 'events', 'rejected_events', 'decisions'] LOOP
        FOR v_row IN
            SELECT t.partition FROM kvledger.time_partitions t
            WHERE t.parent = v_parent ORDER BY t.lo DESC
        LOOP
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM kvledger.%I)', v_row.partition)
               INTO v_used;
            EXIT WHEN v_used;
            EXECUTE format('DROP TABLE kvledger.%I', v_row.partition);
            DELETE FROM kvledger.time_partitions t WHERE t.partition = v_row.partition;
        END LOOP;
    END LOOP;
    -- Ahead: three intervals, or up to ten minutes' worth of at most 30 of them.
    RETURN kvledger.ensure_partitions(now(), now() + greatest(
        3 * p_interval, least(interval '10 minutes', 30 * p_interval)));
END
$$;
"""

_FUNCTIONS_BEFORE = r"""
-- The partition key of each partitioned table, as an expression over its columns.
CREATE OR REPLACE FUNCTION kvledger.partition_key(p_parent text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE p_parent
        WHEN 'residency_history' THEN 'coalesce(closed_at, ''infinity''::timestamptz)'
        WHEN 'events' THEN 'applied_at'
        WHEN 'rejected_events' THEN 'first_seen'
    END
$$;

-- Make the partitions that cover [p_from, p_until), continuing from the newest one (or,
-- when there is none or it ended before p_from, from p_from's interval boundary). A row
-- already in the default partition for a new range is moved into it. Returns how many
-- partitions it made.
CREATE OR REPLACE FUNCTION kvledger.ensure_partitions(p_from timestamptz, p_until timestamptz)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_iv interval;
    v_step double precision;
    v_parent text;
    v_key text;
    v_lo timestamptz;
    v_hi timestamptz;
    v_name text;
    v_made integer := 0;
    v_stray boolean;
BEGIN
    -- One maker at a time (every consumer of a group runs passes): a second waits, then
    -- finds the partitions made.
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    SELECT partition_interval INTO STRICT v_iv FROM kvledger.retention_settings;
    v_step := extract(epoch FROM v_iv);
    FOREACH v_parent IN ARRAY ARRAY['residency_history', 'events', 'rejected_events'] LOOP
        v_key := kvledger.partition_key(v_parent);
        v_lo := to_timestamp(floor(extract(epoch FROM p_from) / v_step) * v_step);
        SELECT greatest(v_lo, max(t.hi)) INTO v_lo
          FROM kvledger.time_partitions t WHERE t.parent = v_parent;
        WHILE v_lo < p_until LOOP
            v_hi := v_lo + v_iv;
            v_name := format('%s_p%s', v_parent,
                             to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS'));
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM kvledger.%I WHERE %s >= $1 AND %s < $2)',
                           v_parent || '_default', v_key, v_key)
               INTO v_stray USING v_lo, v_hi;
            IF v_stray THEN
                EXECUTE format('CREATE TEMP TABLE kvledger_stray ON COMMIT DROP AS '
                               'WITH d AS (DELETE FROM kvledger.%I WHERE %s >= $1 AND %s < $2 '
                               'RETURNING *) SELECT * FROM d',
                               v_parent || '_default', v_key, v_key) USING v_lo, v_hi;
            END IF;
            EXECUTE format('CREATE TABLE kvledger.%I PARTITION OF kvledger.%I '
                           'FOR VALUES FROM (%L) TO (%L)', v_name, v_parent, v_lo, v_hi);
            IF v_stray THEN
                EXECUTE format('INSERT INTO kvledger.%I SELECT * FROM kvledger_stray', v_parent);
                DROP TABLE kvledger_stray;
            END IF;
            INSERT INTO kvledger.time_partitions (parent, partition, lo, hi)
            VALUES (v_parent, v_name, v_lo, v_hi);
            v_made := v_made + 1;
            v_lo := v_hi;
        END LOOP;
    END LOOP;
    RETURN v_made;
END
$$;

-- Drop every partition that ended at or before its table's cut-off (history: p_history;
-- events and rejected_events: p_audit), and delete the default partitions' rows before it.
-- Each table's retained window then starts at the newest dropped partition's end.
CREATE OR REPLACE FUNCTION kvledger.drop_partitions(p_history timestamptz, p_audit timestamptz)
RETURNS TABLE (parent text, partition text, lo timestamptz, hi timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_row record;
    v_parent text;
    v_cut timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    FOR v_row IN
        SELECT t.parent, t.partition, t.lo, t.hi FROM kvledger.time_partitions t
        WHERE t.hi <= CASE t.parent WHEN 'residency_history' THEN p_history ELSE p_audit END
        ORDER BY t.parent, t.lo
    LOOP
        EXECUTE format('DROP TABLE kvledger.%I', v_row.partition);
        DELETE FROM kvledger.time_partitions t WHERE t.partition = v_row.partition;
        INSERT INTO kvledger.retained_windows AS w (what, since) VALUES (v_row.parent, v_row.hi)
        ON CONFLICT (what) DO UPDATE SET since = greatest(w.since, EXCLUDED.since),
            updated_at = now();
        parent := v_row.parent; partition := v_row.partition; lo := v_row.lo; hi := v_row.hi;
        RETURN NEXT;
    END LOOP;
    FOREACH v_parent IN ARRAY ARRAY['residency_history', 'events', 'rejected_events'] LOOP
        v_cut := CASE v_parent WHEN 'residency_history' THEN p_history ELSE p_audit END;
        EXECUTE format('DELETE FROM kvledger.%I WHERE %s < $1', v_parent || '_default',
                       kvledger.partition_key(v_parent)) USING v_cut;
    END LOOP;
END
$$;

-- A new partition interval. Each table's newest partitions that hold no row are dropped
-- and made again at the new interval, from now: it applies at once on a new or idle index,
-- else from the end of the newest partition holding rows.
CREATE OR REPLACE FUNCTION kvledger.set_partition_interval(p_interval interval)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_parent text;
    v_row record;
    v_used boolean;
BEGIN
    IF p_interval < interval '1 second' THEN
        RAISE EXCEPTION 'the partition interval must be at least 1 second, not %', p_interval
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    UPDATE kvledger.retention_settings SET partition_interval = p_interval, updated_at = now();
    FOREACH v_parent IN ARRAY ARRAY['residency_history', 'events', 'rejected_events'] LOOP
        FOR v_row IN
            SELECT t.partition FROM kvledger.time_partitions t
            WHERE t.parent = v_parent ORDER BY t.lo DESC
        LOOP
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM kvledger.%I)', v_row.partition)
               INTO v_used;
            EXIT WHEN v_used;
            EXECUTE format('DROP TABLE kvledger.%I', v_row.partition);
            DELETE FROM kvledger.time_partitions t WHERE t.partition = v_row.partition;
        END LOOP;
    END LOOP;
    -- Ahead: three intervals, or up to ten minutes' worth of at most 30 of them.
    RETURN kvledger.ensure_partitions(now(), now() + greatest(
        3 * p_interval, least(interval '10 minutes', 30 * p_interval)));
END
$$;
"""


def upgrade() -> None:
    op.execute(_FUNCTIONS)
    op.execute(_TABLES)
    # Partitions for the new table from now, as the others have them.
    op.execute(
        "SELECT kvledger.ensure_partitions(now(), now() + greatest(3 * partition_interval, "
        "least(interval '10 minutes', 30 * partition_interval))) "
        "FROM kvledger.retention_settings"
    )


def downgrade() -> None:
    op.execute("DROP VIEW kvledger.decision_funnel; DROP VIEW kvledger.decision_outcomes;")
    op.execute("DELETE FROM kvledger.time_partitions WHERE parent = 'decisions'")
    op.execute("DELETE FROM kvledger.retained_windows WHERE what = 'decisions'")
    op.execute("DROP TABLE kvledger.decisions, kvledger.rejected_decisions")
    op.execute(_FUNCTIONS_BEFORE)
