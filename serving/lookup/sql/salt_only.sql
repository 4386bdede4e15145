-- kvledger.salt_only as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.salt_only(p_extra text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT CASE
        WHEN p_extra IS NULL THEN false
        WHEN jsonb_typeof(p_extra::jsonb) <> 'array' THEN false
        ELSE jsonb_array_length(p_extra::jsonb) = 1
             AND jsonb_typeof(p_extra::jsonb -> 0) = 'string'
    END
$function$
