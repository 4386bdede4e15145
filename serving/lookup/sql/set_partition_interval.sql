-- kvledger.set_partition_interval as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.set_partition_interval(p_interval interval)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$
