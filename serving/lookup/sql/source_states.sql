-- kvledger.source_states as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.source_states(p_silent_after interval DEFAULT NULL::interval)
 RETURNS TABLE(source text, state text)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT s.source,
           CASE
               WHEN s.closed_at IS NOT NULL THEN 'closed'
               WHEN s.last_seen < now() - coalesce(p_silent_after, kvledger.silent_after())
                   THEN 'silent'
               ELSE 'live'
           END
    FROM kvledger.sources s
$function$

