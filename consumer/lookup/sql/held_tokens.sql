-- kvledger.held_tokens as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.held_tokens(p_model text, p_group integer, p_tokens integer[], p_lora text DEFAULT NULL::text, p_salt text DEFAULT NULL::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint)
 LANGUAGE sql
 STABLE
AS $function$
            WITH RECURSIVE spec AS (
                SELECT block_size, hash_block_size FROM kvledger.group_specs
                WHERE model = p_model AND group_idx = p_group
            ),
            chain(h, i) AS (
                SELECT b.block_hash, 1
                FROM kvledger.blocks b, spec
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash IS NULL
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND b.token_ids = p_tokens[1:spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora
                  AND kvledger.first_under(b.extra_keys, p_salt)
                UNION ALL
                SELECT b.block_hash, c.i + 1
                FROM chain c, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = c.h
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND (c.i + 1) * spec.block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[c.i * spec.block_size + 1:(c.i + 1) * spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora
                  AND b.extra_keys IS NULL
            ),
            tip AS (
                SELECT (SELECT h FROM chain ORDER BY i DESC LIMIT 1) AS h,
                       (SELECT count(*) FROM chain)::integer * spec.block_size AS pos
                FROM spec
            ),
            tail(h, j, pos) AS (
                SELECT b.block_hash, 1, tip.pos + spec.hash_block_size
                FROM tip, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group
                  AND b.parent_hash IS NOT DISTINCT FROM tip.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND tip.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[tip.pos + 1:tip.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora
                  AND CASE WHEN tip.h IS NULL THEN kvledger.first_under(b.extra_keys, p_salt)
                           ELSE b.extra_keys IS NULL END
                UNION ALL
                SELECT b.block_hash, t.j + 1, t.pos + spec.hash_block_size
                FROM tail t, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = t.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND t.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[t.pos + 1:t.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora
                  AND b.extra_keys IS NULL
            )
            SELECT m.instance, m.medium, m.ownership,
                   least(m.matched_blocks, (SELECT count(*) FROM chain))::integer,
                   m.matched_tokens
            FROM kvledger.held_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h)) m

        $function$
