-- kvledger.match_tokens as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.match_tokens(p_model text, p_group integer, p_tokens integer[], p_lora text DEFAULT NULL::text, p_include_silent boolean DEFAULT false, p_silent_after interval DEFAULT NULL::interval, p_salt text DEFAULT NULL::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint, source_state text)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens,
           coalesce(s.state, 'unknown')
    FROM kvledger.held_tokens(p_model, p_group, p_tokens, p_lora, p_salt) h
    LEFT JOIN kvledger.source_states(p_silent_after) s ON s.source = h.instance
    WHERE p_include_silent OR s.state = 'live'
$function$
