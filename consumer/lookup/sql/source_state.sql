-- kvledger.source_state as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.source_state(p_source text, p_silent_after interval DEFAULT NULL::interval)
 RETURNS text
 LANGUAGE sql
 STABLE
AS $function$
    SELECT coalesce(
        (SELECT CASE
                    WHEN s.closed_at IS NOT NULL THEN 'closed'
                    WHEN s.last_seen < now() - coalesce(p_silent_after, kvledger.silent_after())
                        THEN 'silent'
                    ELSE 'live'
                END
         FROM kvledger.sources s WHERE s.source = p_source),
        'unknown')
$function$

