-- kvledger.partition_key as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.partition_key(p_parent text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT CASE p_parent
        WHEN 'residency_history' THEN 'coalesce(closed_at, ''infinity''::timestamptz)'
        WHEN 'events' THEN 'applied_at'
        WHEN 'rejected_events' THEN 'first_seen'
        WHEN 'decisions' THEN 'recorded_at'
    END
$function$
