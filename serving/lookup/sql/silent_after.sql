-- kvledger.silent_after as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.silent_after()
 RETURNS interval
 LANGUAGE sql
 STABLE
AS $function$
    SELECT coalesce(nullif(current_setting('kvledger.silent_after', true), '')::interval,
                    interval '30 seconds')
$function$

