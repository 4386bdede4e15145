-- kvledger.source_state as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.source_state(p_source text, p_silent_after interval DEFAULT NULL::interval)
 RETURNS text
 LANGUAGE sql
 STABLE
AS $function$
    SELECT coalesce(
        (SELECT s.state FROM kvledger.source_states(p_silent_after) s
         WHERE s.source = p_source),
        'unknown')
$function$

