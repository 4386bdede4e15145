"""Token walks of salted prompts: a first block whose only extra key is a cache salt.

A first block whose only extra key is a cache salt (``["<salt>"]``: vLLM publishes a
salted request's first block so, and so does the SGLang relay) is walkable by tokens:
``held_tokens`` and ``match_tokens`` take ``p_salt``, and the walk of a salt starts at the
first blocks of that salt (every later block, with no extra key, is reached through its
parent, whose hash the salt already namespaces). Without ``p_salt`` the answers are as
before: a salted first block is never reached.

- ``first_under(extra_keys, salt)``: a first block the walk of ``salt`` (NULL: none) starts
  at; ``salt_only(extra_keys)``: its extra keys are one string (a cache salt).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_UPGRADE = r"""
CREATE FUNCTION kvledger.salt_only(p_extra text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_extra IS NULL THEN false
        WHEN jsonb_typeof(p_extra::jsonb) <> 'array' THEN false
        ELSE jsonb_array_length(p_extra::jsonb) = 1
             AND jsonb_typeof(p_extra::jsonb -> 0) = 'string'
    END
$$;

CREATE FUNCTION kvledger.first_under(p_extra text, p_salt text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_extra IS NULL THEN p_salt IS NULL
        WHEN p_salt IS NULL THEN false
        ELSE kvledger.salt_only(p_extra) AND p_extra::jsonb = jsonb_build_array(p_salt)
    END
$$;

DROP FUNCTION kvledger.match_tokens(text, integer, integer[], text, boolean, interval);
DROP FUNCTION kvledger.held_tokens(text, integer, integer[], text);
CREATE FUNCTION kvledger.held_tokens(p_model text, p_group integer, p_tokens integer[],
    p_lora text DEFAULT NULL::text, p_salt text DEFAULT NULL::text)
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

        $function$;

CREATE FUNCTION kvledger.match_tokens(p_model text, p_group integer, p_tokens integer[],
    p_lora text DEFAULT NULL::text, p_include_silent boolean DEFAULT false,
    p_silent_after interval DEFAULT NULL::interval, p_salt text DEFAULT NULL::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint, source_state text)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens,
           coalesce(s.state, 'unknown')
    FROM kvledger.held_tokens(p_model, p_group, p_tokens, p_lora, p_salt) h
    LEFT JOIN kvledger.source_states(p_silent_after) s ON s.source = h.instance
    WHERE p_include_silent OR s.state = 'live'
$function$;

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

# Revision 0014's definitions, as PostgreSQL printed them.
_DOWNGRADE = r"""
DROP FUNCTION kvledger.match_tokens(text, integer, integer[], text, boolean, interval, text);
DROP FUNCTION kvledger.held_tokens(text, integer, integer[], text, text);
DROP FUNCTION kvledger.first_under(text, text);
DROP FUNCTION kvledger.salt_only(text);
CREATE OR REPLACE FUNCTION kvledger.held_tokens(p_model text, p_group integer, p_tokens integer[], p_lora text DEFAULT NULL::text)
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
            FROM kvledger.held_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h)) m

        $function$;

CREATE OR REPLACE FUNCTION kvledger.match_tokens(p_model text, p_group integer, p_tokens integer[], p_lora text DEFAULT NULL::text, p_include_silent boolean DEFAULT false, p_silent_after interval DEFAULT NULL::interval)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint, source_state text)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens,
           coalesce(s.state, 'unknown')
    FROM kvledger.held_tokens(p_model, p_group, p_tokens, p_lora) h
    LEFT JOIN kvledger.source_states(p_silent_after) s ON s.source = h.instance
    WHERE p_include_silent OR s.state = 'live'
$function$;

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
