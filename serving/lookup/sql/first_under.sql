-- kvledger.first_under as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.first_under(p_extra text, p_salt text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT CASE
        WHEN p_extra IS NULL THEN p_salt IS NULL
        WHEN p_salt IS NULL THEN false
        ELSE kvledger.salt_only(p_extra) AND p_extra::jsonb = jsonb_build_array(p_salt)
    END
$function$
