"""Prefix matches at the group's hash granularity, extended through partial-tail rows.

match_prefix and match_prefix_at take a fourth argument, p_granularity:
- 'block' (the default, the earlier behaviour): p_hashes are block hashes, one per
  block_size tokens, as the events announce them.
- 'hash': p_hashes are the prompt's hashes at the group's hash_block_size (what the engine
  computes, hash_block_size tokens each). A position is covered for a holder when the holder
  holds that hash (a partial-tail row) or the hash that ends its block (a full block: a
  block's hash is the last hash inside it). The match runs over covered positions, so a
  partial tail extends a match by whole hashes past the last full block.
In both, matched_blocks counts whole blocks and matched_tokens counts tokens of the match;
match_tokens follows the same rule (a partial tail adds tokens, not blocks).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# The exact SQL this revision applies, frozen here: no revision imports another, and later
# revisions copy what they change (the current definitions are serving/lookup/sql/*.sql).
_UPGRADE = r"""
        DROP FUNCTION kvledger.match_tokens(text, integer, integer[], text);
        DROP FUNCTION kvledger.match_prefix(text, integer, bytea[]);
        DROP FUNCTION kvledger.match_prefix_at(text, integer, bytea[], timestamptz);
        
        CREATE FUNCTION kvledger.match_prefix(p_model text, p_group integer, p_hashes bytea[],
                                        p_granularity text DEFAULT 'block')
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        DECLARE
            v_ratio integer;
            v_hash_size integer;
        BEGIN
            IF p_granularity = 'block' THEN
                RETURN QUERY WITH held AS (
                SELECT held.*, row_number() OVER (PARTITION BY held.instance, held.medium,
                                                  held.ownership ORDER BY held.i) AS rn
                FROM (
                SELECT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residencies r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h) held
            ),
            runs AS (
                SELECT held.instance, held.medium, held.ownership, max(held.i) AS n
                FROM held WHERE held.i = held.rn
                GROUP BY held.instance, held.medium, held.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
                RETURN;
            ELSIF p_granularity IS DISTINCT FROM 'hash' THEN
                RAISE EXCEPTION 'granularity must be block or hash, not %', p_granularity
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            SELECT s.block_size / s.hash_block_size, s.hash_block_size
              INTO v_ratio, v_hash_size
              FROM kvledger.group_specs s
             WHERE s.model = p_model AND s.group_idx = p_group
               AND s.hash_block_size > 0 AND s.block_size > 0
               AND s.block_size % s.hash_block_size = 0;
            IF NOT FOUND THEN
                RETURN;  -- no spec with a hash size: nothing can be matched by hash
            END IF;
            RETURN QUERY WITH held AS (
                SELECT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residencies r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h),
            covered AS (
                SELECT DISTINCT held.instance, held.medium, held.ownership, c.i
                FROM held CROSS JOIN LATERAL generate_series(
                    CASE WHEN held.i % v_ratio = 0 THEN held.i - v_ratio + 1 ELSE held.i END,
                    held.i) AS c(i)
            ),
            ranked AS (
                SELECT covered.*, row_number() OVER (PARTITION BY covered.instance,
                       covered.medium, covered.ownership ORDER BY covered.i) AS rn
                FROM covered
            ),
            runs AS (
                SELECT ranked.instance, ranked.medium, ranked.ownership, max(ranked.i) AS n
                FROM ranked WHERE ranked.i = ranked.rn
                GROUP BY ranked.instance, ranked.medium, ranked.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership,
                   (runs.n / v_ratio)::integer, runs.n::bigint * v_hash_size
            FROM runs;
        END
        $$;

        CREATE FUNCTION kvledger.match_prefix_at(p_model text, p_group integer, p_hashes bytea[], p_at timestamptz,
                                        p_granularity text DEFAULT 'block')
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        DECLARE
            v_ratio integer;
            v_hash_size integer;
        BEGIN
            IF p_granularity = 'block' THEN
                RETURN QUERY WITH held AS (
                SELECT held.*, row_number() OVER (PARTITION BY held.instance, held.medium,
                                                  held.ownership ORDER BY held.i) AS rn
                FROM (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)) held
            ),
            runs AS (
                SELECT held.instance, held.medium, held.ownership, max(held.i) AS n
                FROM held WHERE held.i = held.rn
                GROUP BY held.instance, held.medium, held.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
                RETURN;
            ELSIF p_granularity IS DISTINCT FROM 'hash' THEN
                RAISE EXCEPTION 'granularity must be block or hash, not %', p_granularity
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            SELECT s.block_size / s.hash_block_size, s.hash_block_size
              INTO v_ratio, v_hash_size
              FROM kvledger.group_specs s
             WHERE s.model = p_model AND s.group_idx = p_group
               AND s.hash_block_size > 0 AND s.block_size > 0
               AND s.block_size % s.hash_block_size = 0;
            IF NOT FOUND THEN
                RETURN;  -- no spec with a hash size: nothing can be matched by hash
            END IF;
            RETURN QUERY WITH held AS (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)),
            covered AS (
                SELECT DISTINCT held.instance, held.medium, held.ownership, c.i
                FROM held CROSS JOIN LATERAL generate_series(
                    CASE WHEN held.i % v_ratio = 0 THEN held.i - v_ratio + 1 ELSE held.i END,
                    held.i) AS c(i)
            ),
            ranked AS (
                SELECT covered.*, row_number() OVER (PARTITION BY covered.instance,
                       covered.medium, covered.ownership ORDER BY covered.i) AS rn
                FROM covered
            ),
            runs AS (
                SELECT ranked.instance, ranked.medium, ranked.ownership, max(ranked.i) AS n
                FROM ranked WHERE ranked.i = ranked.rn
                GROUP BY ranked.instance, ranked.medium, ranked.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership,
                   (runs.n / v_ratio)::integer, runs.n::bigint * v_hash_size
            FROM runs;
        END
        $$;

        -- Walk the hash chain by token content from the start of the prompt: block 1 has no
        -- parent and the prompt's first block_size tokens; block i+1 has block i as parent
        -- and the next block_size tokens. Where the full blocks end, partial-tail rows
        -- (hash_block_size tokens each) extend the walk at hash granularity. Only rows
        -- without extra keys and with the given LoRA take part. Then answer as match_prefix
        -- does for the hashes found.
        CREATE FUNCTION kvledger.match_tokens(p_model text, p_group integer,
                                              p_tokens integer[], p_lora text DEFAULT NULL)
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE sql STABLE AS $$
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
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, c.i + 1
                FROM chain c, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = c.h
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND (c.i + 1) * spec.block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[c.i * spec.block_size + 1:(c.i + 1) * spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
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
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, t.j + 1, t.pos + spec.hash_block_size
                FROM tail t, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = t.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND t.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[t.pos + 1:t.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
            )
            SELECT m.instance, m.medium, m.ownership,
                   least(m.matched_blocks, (SELECT count(*) FROM chain))::integer,
                   m.matched_tokens
            FROM kvledger.match_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h)) m

        $$;
        
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
                GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA kvledger TO kvledger_reader;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'kvledger_reader not granted: %', SQLERRM;
        END
        $$;
"""

_DOWNGRADE = r"""
        DROP FUNCTION kvledger.match_tokens(text, integer, integer[], text);
        DROP FUNCTION kvledger.match_prefix(text, integer, bytea[], text);
        DROP FUNCTION kvledger.match_prefix_at(text, integer, bytea[], timestamptz, text);
        
        CREATE FUNCTION kvledger.match_prefix(p_model text, p_group integer, p_hashes bytea[])
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        BEGIN
            RETURN QUERY WITH held AS (
                SELECT held.*, row_number() OVER (PARTITION BY held.instance, held.medium,
                                                  held.ownership ORDER BY held.i) AS rn
                FROM (
                SELECT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residencies r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h) held
            ),
            runs AS (
                SELECT held.instance, held.medium, held.ownership, max(held.i) AS n
                FROM held WHERE held.i = held.rn
                GROUP BY held.instance, held.medium, held.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
        END
        $$;
        
        CREATE FUNCTION kvledger.match_prefix_at(p_model text, p_group integer, p_hashes bytea[], p_at timestamptz)
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        BEGIN
            RETURN QUERY WITH held AS (
                SELECT held.*, row_number() OVER (PARTITION BY held.instance, held.medium,
                                                  held.ownership ORDER BY held.i) AS rn
                FROM (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)) held
            ),
            runs AS (
                SELECT held.instance, held.medium, held.ownership, max(held.i) AS n
                FROM held WHERE held.i = held.rn
                GROUP BY held.instance, held.medium, held.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
        END
        $$;
        
        -- Walk the hash chain by token content from the start of the prompt: block 1 has no
        -- parent and the prompt's first block_size tokens; block i+1 has block i as parent
        -- and the next block_size tokens. Where the full blocks end, partial-tail rows
        -- (hash_block_size tokens each) extend the walk at hash granularity. Only rows
        -- without extra keys and with the given LoRA take part. Then answer as match_prefix
        -- does for the hashes found.
        CREATE FUNCTION kvledger.match_tokens(p_model text, p_group integer,
                                              p_tokens integer[], p_lora text DEFAULT NULL)
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE sql STABLE AS $$
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
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, c.i + 1
                FROM chain c, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = c.h
                  AND NOT b.partial AND b.block_size = spec.block_size
                  AND (c.i + 1) * spec.block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[c.i * spec.block_size + 1:(c.i + 1) * spec.block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
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
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
                UNION ALL
                SELECT b.block_hash, t.j + 1, t.pos + spec.hash_block_size
                FROM tail t, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group AND b.parent_hash = t.h
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND t.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[t.pos + 1:t.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora AND b.extra_keys IS NULL
            )
            SELECT * FROM kvledger.match_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h))

        $$;
        
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
                GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA kvledger TO kvledger_reader;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'kvledger_reader not granted: %', SQLERRM;
        END
        $$;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
