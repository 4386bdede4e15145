"""History and audit in time partitions, so retention drops whole partitions.

- ``residency_history``, ``events`` and ``rejected_events`` become declaratively
  partitioned tables, by the time the index wrote or closed each row (the database's clock,
  never a producer's):
  - ``residency_history`` by ``closed_at``, a new column: when the interval was closed (NULL
    while open). Open intervals live in ``residency_history_open`` (the key
    ``coalesce(closed_at, 'infinity')``), so dropping a partition never ends a live one.
  - ``events`` by ``applied_at``; ``rejected_events`` by ``first_seen``.
  Each also has a ``_default`` partition, empty while partitions are made ahead; a row that
  lands there (partitions ran out) is moved into its partition when that one is made.
- ``kvledger.retention_settings``: the partition interval (``kvledger migrate
  --partition-interval``, one day by default).
- ``kvledger.time_partitions``: every time partition, its parent and range.
- ``kvledger.retained_windows``: per table, where what is retained starts (the upper bound of
  the newest partition retention dropped, or the cut-off of the last block expiry).
- ``ensure_partitions(from, until)``, ``drop_partitions(history_before, audit_before)`` and
  ``set_partition_interval(interval)``: what ``kvledger retention`` and the consumer call.
- ``match_prefix_at`` refuses a time before the retained history (invalid_parameter_value).

Existing rows keep their times: partitions are made back to the oldest row (at most 35 days;
older rows go to the default partition, where the first retention pass deletes them).
Primary keys of the partitioned tables include their partition key (PostgreSQL's rule).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_HISTORY_COLUMNS = (
    "id, model, group_idx, block_hash, instance, medium, ownership, locality, stored_at, "
    "removed_at, removed_by, stored_partition, stored_offset"
)
_EVENTS_COLUMNS = (
    "kafka_topic, kafka_partition, kafka_offset, source, model, epoch, seq, event_type, "
    "group_idx, medium, ownership, hash_count, noop_count, status, reason, event_time, applied_at"
)
_REJECTED_COLUMNS = (
    "id, kafka_topic, kafka_partition, kafka_offset, kafka_key, raw, reason, detail, source, "
    "first_seen, replayed_at"
)

_FUNCTIONS = r"""
CREATE TABLE kvledger.retention_settings (
    singleton          boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    partition_interval interval    NOT NULL DEFAULT '1 day'
                                   CHECK (partition_interval >= interval '1 second'),
    updated_at         timestamptz NOT NULL DEFAULT now()
);
INSERT INTO kvledger.retention_settings DEFAULT VALUES;

CREATE TABLE kvledger.time_partitions (
    parent    text        NOT NULL,
    partition text        NOT NULL UNIQUE,
    lo        timestamptz NOT NULL,
    hi        timestamptz NOT NULL CHECK (hi > lo),
    PRIMARY KEY (parent, lo)
);

CREATE TABLE kvledger.retained_windows (
    what       text        PRIMARY KEY,
    since      timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The partition key of each partitioned table, as an expression over its columns.
CREATE FUNCTION kvledger.partition_key(p_parent text) RETURNS text
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
CREATE FUNCTION kvledger.ensure_partitions(p_from timestamptz, p_until timestamptz)
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
CREATE FUNCTION kvledger.drop_partitions(p_history timestamptz, p_audit timestamptz)
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
CREATE FUNCTION kvledger.set_partition_interval(p_interval interval)
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

_TABLES = rf"""
DROP VIEW kvledger.residency_timeline;
DROP VIEW kvledger.rejected_summary;

ALTER TABLE kvledger.residency_history RENAME TO residency_history_0013;
ALTER TABLE kvledger.residency_history_0013 DROP CONSTRAINT residency_history_pkey;
DROP INDEX kvledger.residency_history_block_idx, kvledger.residency_history_open_idx,
    kvledger.residency_history_instance_idx;
ALTER SEQUENCE kvledger.residency_history_id_seq OWNED BY NONE;
ALTER TABLE kvledger.residency_history_0013 ALTER COLUMN id DROP DEFAULT;
CREATE TABLE kvledger.residency_history (
    id           bigint      NOT NULL DEFAULT nextval('kvledger.residency_history_id_seq'),
    model        text        NOT NULL,
    group_idx    integer     NOT NULL,
    block_hash   bytea       NOT NULL,
    instance     text        NOT NULL,
    medium       text        NOT NULL,
    ownership    text        NOT NULL DEFAULT '',
    locality     text,
    stored_at    timestamptz NOT NULL,
    removed_at   timestamptz,
    removed_by   text CONSTRAINT residency_history_removed_by_check
                 CHECK (removed_by IN ('removed', 'cleared', 'restart', 'closed', 'lost')),
    stored_partition integer NOT NULL,
    stored_offset    bigint  NOT NULL,
    closed_at    timestamptz,
    CHECK (removed_at IS NULL OR removed_at >= stored_at),
    CHECK ((removed_at IS NULL) = (closed_at IS NULL))
) PARTITION BY RANGE ((coalesce(closed_at, 'infinity'::timestamptz)));
ALTER SEQUENCE kvledger.residency_history_id_seq OWNED BY kvledger.residency_history.id;
CREATE TABLE kvledger.residency_history_open PARTITION OF kvledger.residency_history
    FOR VALUES FROM ('infinity') TO (MAXVALUE);
CREATE TABLE kvledger.residency_history_default PARTITION OF kvledger.residency_history DEFAULT;
CREATE INDEX residency_history_block_idx
    ON kvledger.residency_history (model, group_idx, block_hash, stored_at);
CREATE INDEX residency_history_instance_idx ON kvledger.residency_history (instance, stored_at);
-- One open interval per residency: every open interval is in the open partition.
CREATE UNIQUE INDEX residency_history_open_idx
    ON kvledger.residency_history_open (model, group_idx, block_hash, instance, medium, ownership)
    WHERE removed_at IS NULL;

ALTER TABLE kvledger.events RENAME TO events_0013;
ALTER TABLE kvledger.events_0013 DROP CONSTRAINT events_pkey;
DROP INDEX kvledger.events_source_idx;
CREATE TABLE kvledger.events (
    kafka_topic     text     NOT NULL,
    kafka_partition integer  NOT NULL,
    kafka_offset    bigint   NOT NULL,
    source       text,
    model        text,
    epoch        bigint,
    seq          bigint,
    event_type   text,
    group_idx    integer,
    medium       text,
    ownership    text,
    hash_count   integer     NOT NULL DEFAULT 0,
    noop_count   integer     NOT NULL DEFAULT 0,
    status       text        NOT NULL CHECK (status IN ('applied', 'rejected', 'duplicate')),
    reason       text,
    event_time   timestamptz,
    applied_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT events_pkey PRIMARY KEY (kafka_topic, kafka_partition, kafka_offset, applied_at)
) PARTITION BY RANGE (applied_at);
CREATE TABLE kvledger.events_default PARTITION OF kvledger.events DEFAULT;
CREATE INDEX events_source_idx ON kvledger.events (source, event_time);

ALTER TABLE kvledger.rejected_events RENAME TO rejected_events_0013;
ALTER TABLE kvledger.rejected_events_0013 DROP CONSTRAINT rejected_events_pkey,
    DROP CONSTRAINT rejected_events_kafka_topic_kafka_partition_kafka_offset_key;
DROP INDEX kvledger.rejected_events_reason_idx;
ALTER SEQUENCE kvledger.rejected_events_id_seq OWNED BY NONE;
ALTER TABLE kvledger.rejected_events_0013 ALTER COLUMN id DROP DEFAULT;
CREATE TABLE kvledger.rejected_events (
    id              bigint      NOT NULL DEFAULT nextval('kvledger.rejected_events_id_seq'),
    kafka_topic     text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    kafka_key       bytea,
    raw             bytea       NOT NULL,
    reason          text        NOT NULL,
    detail          text        NOT NULL,
    source          text,
    first_seen      timestamptz NOT NULL DEFAULT now(),
    replayed_at     timestamptz,
    CONSTRAINT rejected_events_offset_key
        UNIQUE (kafka_topic, kafka_partition, kafka_offset, first_seen)
) PARTITION BY RANGE (first_seen);
ALTER SEQUENCE kvledger.rejected_events_id_seq OWNED BY kvledger.rejected_events.id;
CREATE TABLE kvledger.rejected_events_default PARTITION OF kvledger.rejected_events DEFAULT;
CREATE INDEX rejected_events_reason_idx ON kvledger.rejected_events (reason);
CREATE INDEX rejected_events_id_idx ON kvledger.rejected_events (id);
CREATE INDEX rejected_events_offset_idx
    ON kvledger.rejected_events (kafka_topic, kafka_partition, kafka_offset);

-- Partitions back to the oldest row (at most 35 days) and ahead.
SELECT kvledger.ensure_partitions(
    greatest(now() - interval '35 days', least(
        (SELECT min(least(removed_at, now())) FROM kvledger.residency_history_0013),
        (SELECT min(applied_at) FROM kvledger.events_0013),
        (SELECT min(first_seen) FROM kvledger.rejected_events_0013),
        now())),
    now() + interval '3 days');

INSERT INTO kvledger.residency_history ({_HISTORY_COLUMNS}, closed_at)
SELECT {_HISTORY_COLUMNS},
       CASE WHEN removed_at IS NULL THEN NULL ELSE least(removed_at, now()) END
FROM kvledger.residency_history_0013;
INSERT INTO kvledger.events ({_EVENTS_COLUMNS})
SELECT {_EVENTS_COLUMNS} FROM kvledger.events_0013;
INSERT INTO kvledger.rejected_events ({_REJECTED_COLUMNS})
SELECT {_REJECTED_COLUMNS} FROM kvledger.rejected_events_0013;
DROP TABLE kvledger.residency_history_0013, kvledger.events_0013,
    kvledger.rejected_events_0013;

-- The auditors' views, as 0002 made them; what they show starts at retained_windows.
CREATE VIEW kvledger.rejected_summary AS
    SELECT reason, count(*) AS total,
           count(*) FILTER (WHERE replayed_at IS NULL) AS pending,
           min(first_seen) AS first_seen, max(first_seen) AS last_seen
    FROM kvledger.rejected_events GROUP BY reason;
CREATE VIEW kvledger.residency_timeline AS
    SELECT model, group_idx, block_hash, instance, medium, ownership, locality,
           stored_at, removed_at, removed_by,
           coalesce(removed_at, now()) - stored_at AS held_for
    FROM kvledger.residency_history;
COMMENT ON VIEW kvledger.residency_timeline IS
    'Residency intervals closed since retained_windows(residency_history), and every open one';
COMMENT ON VIEW kvledger.rejected_summary IS
    'Rejections since retained_windows(rejected_events)';
"""

_DOWNGRADE = rf"""
DROP VIEW kvledger.residency_timeline;
DROP VIEW kvledger.rejected_summary;

ALTER TABLE kvledger.residency_history RENAME TO residency_history_0014;
DROP INDEX kvledger.residency_history_block_idx, kvledger.residency_history_open_idx,
    kvledger.residency_history_instance_idx;
ALTER SEQUENCE kvledger.residency_history_id_seq OWNED BY NONE;
ALTER TABLE kvledger.residency_history_0014 ALTER COLUMN id DROP DEFAULT;
CREATE TABLE kvledger.residency_history (
    id           bigint      PRIMARY KEY DEFAULT nextval('kvledger.residency_history_id_seq'),
    model        text        NOT NULL,
    group_idx    integer     NOT NULL,
    block_hash   bytea       NOT NULL,
    instance     text        NOT NULL,
    medium       text        NOT NULL,
    ownership    text        NOT NULL DEFAULT '',
    locality     text,
    stored_at    timestamptz NOT NULL,
    removed_at   timestamptz,
    removed_by   text CONSTRAINT residency_history_removed_by_check
                 CHECK (removed_by IN ('removed', 'cleared', 'restart', 'closed', 'lost')),
    stored_partition integer NOT NULL,
    stored_offset    bigint  NOT NULL,
    CHECK (removed_at IS NULL OR removed_at >= stored_at)
);
ALTER SEQUENCE kvledger.residency_history_id_seq OWNED BY kvledger.residency_history.id;
INSERT INTO kvledger.residency_history ({_HISTORY_COLUMNS})
SELECT {_HISTORY_COLUMNS} FROM kvledger.residency_history_0014;
DROP TABLE kvledger.residency_history_0014;
CREATE INDEX residency_history_block_idx
    ON kvledger.residency_history (model, group_idx, block_hash, stored_at);
CREATE UNIQUE INDEX residency_history_open_idx
    ON kvledger.residency_history (model, group_idx, block_hash, instance, medium, ownership)
    WHERE removed_at IS NULL;
CREATE INDEX residency_history_instance_idx ON kvledger.residency_history (instance, stored_at);

ALTER TABLE kvledger.events RENAME TO events_0014;
ALTER TABLE kvledger.events_0014 DROP CONSTRAINT events_pkey;
DROP INDEX kvledger.events_source_idx;
CREATE TABLE kvledger.events (
    kafka_topic     text     NOT NULL,
    kafka_partition integer  NOT NULL,
    kafka_offset    bigint   NOT NULL,
    source       text,
    model        text,
    epoch        bigint,
    seq          bigint,
    event_type   text,
    group_idx    integer,
    medium       text,
    ownership    text,
    hash_count   integer     NOT NULL DEFAULT 0,
    noop_count   integer     NOT NULL DEFAULT 0,
    status       text        NOT NULL CHECK (status IN ('applied', 'rejected', 'duplicate')),
    reason       text,
    event_time   timestamptz,
    applied_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (kafka_topic, kafka_partition, kafka_offset)
);
INSERT INTO kvledger.events ({_EVENTS_COLUMNS})
SELECT DISTINCT ON (kafka_topic, kafka_partition, kafka_offset) {_EVENTS_COLUMNS}
FROM kvledger.events_0014 ORDER BY kafka_topic, kafka_partition, kafka_offset, applied_at DESC;
DROP TABLE kvledger.events_0014;
CREATE INDEX events_source_idx ON kvledger.events (source, event_time);

ALTER TABLE kvledger.rejected_events RENAME TO rejected_events_0014;
ALTER TABLE kvledger.rejected_events_0014 DROP CONSTRAINT rejected_events_offset_key;
DROP INDEX kvledger.rejected_events_reason_idx, kvledger.rejected_events_id_idx,
    kvledger.rejected_events_offset_idx;
ALTER SEQUENCE kvledger.rejected_events_id_seq OWNED BY NONE;
ALTER TABLE kvledger.rejected_events_0014 ALTER COLUMN id DROP DEFAULT;
CREATE TABLE kvledger.rejected_events (
    id              bigint      PRIMARY KEY DEFAULT nextval('kvledger.rejected_events_id_seq'),
    kafka_topic     text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    kafka_key       bytea,
    raw             bytea       NOT NULL,
    reason          text        NOT NULL,
    detail          text        NOT NULL,
    source          text,
    first_seen      timestamptz NOT NULL DEFAULT now(),
    replayed_at     timestamptz,
    UNIQUE (kafka_topic, kafka_partition, kafka_offset)
);
ALTER SEQUENCE kvledger.rejected_events_id_seq OWNED BY kvledger.rejected_events.id;
INSERT INTO kvledger.rejected_events ({_REJECTED_COLUMNS})
SELECT DISTINCT ON (kafka_topic, kafka_partition, kafka_offset) {_REJECTED_COLUMNS}
FROM kvledger.rejected_events_0014 ORDER BY kafka_topic, kafka_partition, kafka_offset, id;
DROP TABLE kvledger.rejected_events_0014;
CREATE INDEX rejected_events_reason_idx ON kvledger.rejected_events (reason);

DROP FUNCTION kvledger.set_partition_interval(interval);
DROP FUNCTION kvledger.drop_partitions(timestamptz, timestamptz);
DROP FUNCTION kvledger.ensure_partitions(timestamptz, timestamptz);
DROP FUNCTION kvledger.partition_key(text);
DROP TABLE kvledger.retained_windows, kvledger.time_partitions, kvledger.retention_settings;

CREATE VIEW kvledger.rejected_summary AS
    SELECT reason, count(*) AS total,
           count(*) FILTER (WHERE replayed_at IS NULL) AS pending,
           min(first_seen) AS first_seen, max(first_seen) AS last_seen
    FROM kvledger.rejected_events GROUP BY reason;
CREATE VIEW kvledger.residency_timeline AS
    SELECT model, group_idx, block_hash, instance, medium, ownership, locality,
           stored_at, removed_at, removed_by,
           coalesce(removed_at, now()) - stored_at AS held_for
    FROM kvledger.residency_history;
"""

# match_prefix_at as 0007 made it (frozen) and as this revision makes it: the same body
# behind a check of the retained window.
_MATCH_AT_0007 = r"""
CREATE OR REPLACE FUNCTION kvledger.match_prefix_at(p_model text, p_group integer, p_hashes bytea[], p_at timestamp with time zone, p_granularity text DEFAULT 'block'::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint)
 LANGUAGE plpgsql
 STABLE
AS $function$
        DECLARE
            v_ratio integer;
            v_hash_size integer;
        BEGIN
            IF p_granularity = 'block' THEN
                RETURN QUERY WITH held AS MATERIALIZED (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)),
            agg AS (
                SELECT held.instance, held.medium, held.ownership, count(*) AS c,
                       min(held.i) AS lo, max(held.i) AS hi
                FROM held
                GROUP BY held.instance, held.medium, held.ownership
            ),
            gapped AS (
                SELECT held.instance, held.medium, held.ownership, held.i,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.i) AS rn
                FROM held
                JOIN agg ON agg.instance = held.instance AND agg.medium = held.medium
                        AND agg.ownership = held.ownership
                WHERE agg.lo = 1 AND agg.c <> agg.hi
            ),
            runs AS (
                SELECT agg.instance, agg.medium, agg.ownership, agg.hi AS n
                FROM agg WHERE agg.lo = 1 AND agg.c = agg.hi
                UNION ALL
                SELECT gapped.instance, gapped.medium, gapped.ownership, max(gapped.i)
                FROM gapped WHERE gapped.i = gapped.rn
                GROUP BY gapped.instance, gapped.medium, gapped.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
                RETURN;
            ELSIF p_granularity IS DISTINCT FROM 'hash' THEN
                RAISE EXCEPTION 'granularity must be block or hash, not %', p_granularity
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            SELECT s.block_size / s.hash_block_size, s.hash_block_size
              INTO v_ratio, v_hash_size
              FROM kvledger.group_specs s
             WHERE s.model = p_model AND s.group_idx = p_group
               AND s.hash_block_size > 0 AND s.block_size > 0
               AND s.block_size % s.hash_block_size = 0;
            IF NOT FOUND THEN
                RETURN;  -- no spec with a hash size: nothing can be matched by hash
            END IF;
            RETURN QUERY WITH held AS MATERIALIZED (
                SELECT DISTINCT h.instance, h.medium, h.ownership, c.i
                FROM (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)) h CROSS JOIN LATERAL generate_series(
                    CASE WHEN h.i % v_ratio = 0 THEN h.i - v_ratio + 1 ELSE h.i END,
                    h.i) AS c(i)),
            agg AS (
                SELECT held.instance, held.medium, held.ownership, count(*) AS c,
                       min(held.i) AS lo, max(held.i) AS hi
                FROM held
                GROUP BY held.instance, held.medium, held.ownership
            ),
            gapped AS (
                SELECT held.instance, held.medium, held.ownership, held.i,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.i) AS rn
                FROM held
                JOIN agg ON agg.instance = held.instance AND agg.medium = held.medium
                        AND agg.ownership = held.ownership
                WHERE agg.lo = 1 AND agg.c <> agg.hi
            ),
            runs AS (
                SELECT agg.instance, agg.medium, agg.ownership, agg.hi AS n
                FROM agg WHERE agg.lo = 1 AND agg.c = agg.hi
                UNION ALL
                SELECT gapped.instance, gapped.medium, gapped.ownership, max(gapped.i)
                FROM gapped WHERE gapped.i = gapped.rn
                GROUP BY gapped.instance, gapped.medium, gapped.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership,
                   (runs.n / v_ratio)::integer, runs.n::bigint * v_hash_size
            FROM runs;
        END
        $function$

"""

_MATCH_AT_RETAINED = r"""
CREATE OR REPLACE FUNCTION kvledger.match_prefix_at(p_model text, p_group integer, p_hashes bytea[], p_at timestamp with time zone, p_granularity text DEFAULT 'block'::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint)
 LANGUAGE plpgsql
 STABLE
AS $function$
        DECLARE
            v_ratio integer;
            v_hash_size integer;
        BEGIN
            IF p_at < (SELECT w.since FROM kvledger.retained_windows w
                       WHERE w.what = 'residency_history') THEN
                RAISE EXCEPTION 'the residency history before % is not retained: ask for a time at or after it',
                    (SELECT w.since FROM kvledger.retained_windows w
                     WHERE w.what = 'residency_history')
                    USING ERRCODE = 'invalid_parameter_value',
                          HINT = 'kvledger consume --history-retention sets how long it is kept';
            END IF;
            IF p_granularity = 'block' THEN
                RETURN QUERY WITH held AS MATERIALIZED (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)),
            agg AS (
                SELECT held.instance, held.medium, held.ownership, count(*) AS c,
                       min(held.i) AS lo, max(held.i) AS hi
                FROM held
                GROUP BY held.instance, held.medium, held.ownership
            ),
            gapped AS (
                SELECT held.instance, held.medium, held.ownership, held.i,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.i) AS rn
                FROM held
                JOIN agg ON agg.instance = held.instance AND agg.medium = held.medium
                        AND agg.ownership = held.ownership
                WHERE agg.lo = 1 AND agg.c <> agg.hi
            ),
            runs AS (
                SELECT agg.instance, agg.medium, agg.ownership, agg.hi AS n
                FROM agg WHERE agg.lo = 1 AND agg.c = agg.hi
                UNION ALL
                SELECT gapped.instance, gapped.medium, gapped.ownership, max(gapped.i)
                FROM gapped WHERE gapped.i = gapped.rn
                GROUP BY gapped.instance, gapped.medium, gapped.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
                RETURN;
            ELSIF p_granularity IS DISTINCT FROM 'hash' THEN
                RAISE EXCEPTION 'granularity must be block or hash, not %', p_granularity
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            SELECT s.block_size / s.hash_block_size, s.hash_block_size
              INTO v_ratio, v_hash_size
              FROM kvledger.group_specs s
             WHERE s.model = p_model AND s.group_idx = p_group
               AND s.hash_block_size > 0 AND s.block_size > 0
               AND s.block_size % s.hash_block_size = 0;
            IF NOT FOUND THEN
                RETURN;  -- no spec with a hash size: nothing can be matched by hash
            END IF;
            RETURN QUERY WITH held AS MATERIALIZED (
                SELECT DISTINCT h.instance, h.medium, h.ownership, c.i
                FROM (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)) h CROSS JOIN LATERAL generate_series(
                    CASE WHEN h.i % v_ratio = 0 THEN h.i - v_ratio + 1 ELSE h.i END,
                    h.i) AS c(i)),
            agg AS (
                SELECT held.instance, held.medium, held.ownership, count(*) AS c,
                       min(held.i) AS lo, max(held.i) AS hi
                FROM held
                GROUP BY held.instance, held.medium, held.ownership
            ),
            gapped AS (
                SELECT held.instance, held.medium, held.ownership, held.i,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.i) AS rn
                FROM held
                JOIN agg ON agg.instance = held.instance AND agg.medium = held.medium
                        AND agg.ownership = held.ownership
                WHERE agg.lo = 1 AND agg.c <> agg.hi
            ),
            runs AS (
                SELECT agg.instance, agg.medium, agg.ownership, agg.hi AS n
                FROM agg WHERE agg.lo = 1 AND agg.c = agg.hi
                UNION ALL
                SELECT gapped.instance, gapped.medium, gapped.ownership, max(gapped.i)
                FROM gapped WHERE gapped.i = gapped.rn
                GROUP BY gapped.instance, gapped.medium, gapped.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership,
                   (runs.n / v_ratio)::integer, runs.n::bigint * v_hash_size
            FROM runs;
        END
        $function$

"""

_GRANT = r"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA kvledger TO kvledger_reader;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'kvledger_reader not granted: %', SQLERRM;
END
$$;
"""


def upgrade() -> None:
    op.execute(_FUNCTIONS)
    op.execute(_TABLES)
    op.execute(_MATCH_AT_RETAINED)
    op.execute(_GRANT)


def downgrade() -> None:
    op.execute(_MATCH_AT_0007)
    op.execute(_DOWNGRADE)
