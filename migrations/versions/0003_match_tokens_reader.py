"""Lookup by token content, and a read-only role for the lookup service.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


# The answer for the hashes found by the walk (revision 0004 counts a partial tail's hashes
# as tokens, not blocks).
FINAL_SELECT = """
            SELECT * FROM kvledger.match_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h))
"""


def match_tokens_sql(final_select: str) -> str:
    """CREATE FUNCTION kvledger.match_tokens, answering with ``final_select``."""
    return (
        """
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
            )"""
        + final_select
        + """
        $$;
        """
    )


def upgrade() -> None:
    op.execute(
        match_tokens_sql(FINAL_SELECT)
        + """
        -- A read-only role for the lookup service (skipped where roles cannot be created).
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
                CREATE ROLE kvledger_reader NOLOGIN;
            END IF;
            GRANT USAGE ON SCHEMA kvledger TO kvledger_reader;
            GRANT SELECT ON ALL TABLES IN SCHEMA kvledger TO kvledger_reader;
            GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA kvledger TO kvledger_reader;
            EXECUTE format('GRANT kvledger_reader TO %I', current_user);
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'kvledger_reader not created: %', SQLERRM;
        END
        $$;
        """
    )


def downgrade() -> None:
    op.execute(
        """
        DROP FUNCTION IF EXISTS kvledger.match_tokens(text, integer, integer[], text);
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
                REVOKE ALL ON ALL TABLES IN SCHEMA kvledger FROM kvledger_reader;
                REVOKE ALL ON ALL FUNCTIONS IN SCHEMA kvledger FROM kvledger_reader;
                REVOKE ALL ON SCHEMA kvledger FROM kvledger_reader;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'kvledger_reader left as is: %', SQLERRM;
        END
        $$;
        """
    )
