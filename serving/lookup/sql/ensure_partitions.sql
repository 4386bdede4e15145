-- kvledger.ensure_partitions as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.ensure_partitions(p_from timestamp with time zone, p_until timestamp with time zone)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$
