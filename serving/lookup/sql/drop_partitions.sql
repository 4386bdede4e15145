-- kvledger.drop_partitions as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.drop_partitions(p_history timestamp with time zone, p_audit timestamp with time zone)
 RETURNS TABLE(parent text, partition text, lo timestamp with time zone, hi timestamp with time zone)
 LANGUAGE plpgsql
AS $function$
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
$function$
