-- kvledger.drop_table_partitions as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.drop_table_partitions(p_history timestamp with time zone, p_audit timestamp with time zone, p_parent text)
 RETURNS TABLE(parent text, partition text, lo timestamp with time zone, hi timestamp with time zone)
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_row record;
    v_cut timestamptz := CASE p_parent WHEN 'residency_history' THEN p_history ELSE p_audit END;
BEGIN
    IF p_parent NOT IN ('residency_history', 'events', 'rejected_events', 'decisions') THEN
        RAISE EXCEPTION 'not a partitioned table of kvledger: %', p_parent
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    FOR v_row IN
        SELECT t.parent, t.partition, t.lo, t.hi FROM kvledger.time_partitions t
        WHERE t.parent = p_parent AND t.hi <= v_cut ORDER BY t.lo
    LOOP
        EXECUTE format('DROP TABLE kvledger.%I', v_row.partition);
        DELETE FROM kvledger.time_partitions t WHERE t.partition = v_row.partition;
        INSERT INTO kvledger.retained_windows AS w (what, since) VALUES (v_row.parent, v_row.hi)
        ON CONFLICT (what) DO UPDATE SET since = greatest(w.since, EXCLUDED.since),
            updated_at = now();
        parent := v_row.parent; partition := v_row.partition; lo := v_row.lo; hi := v_row.hi;
        RETURN NEXT;
    END LOOP;
    EXECUTE format('DELETE FROM kvledger.%I WHERE %s < $1', p_parent || '_default',
                   kvledger.partition_key(p_parent)) USING v_cut;
END
$function$
