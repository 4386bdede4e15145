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

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# One holder's run over covered positions: rows (instance, medium, ownership, i) are held
# positions; a held block end (i a multiple of v_ratio) also covers the v_ratio - 1 positions
# before it. {held} is a query over one residency relation.
_HASH_RUNS = """
            WITH held AS ({held}),
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
"""

_HELD_NOW = """
                SELECT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residencies r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h"""

_HELD_AT = """
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)"""

# The block-granularity answer (as in revision 0002), then the hash-granularity one.
_BLOCK_RUNS = """
            WITH held AS (
                SELECT held.*, row_number() OVER (PARTITION BY held.instance, held.medium,
                                                  held.ownership ORDER BY held.i) AS rn
                FROM ({held}) held
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
"""

_FUNCTION = """
        CREATE FUNCTION kvledger.{name}(p_model text, p_group integer, p_hashes bytea[]{extra},
                                        p_granularity text DEFAULT 'block')
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        DECLARE
            v_ratio integer;
            v_hash_size integer;
        BEGIN
            IF p_granularity = 'block' THEN
                RETURN QUERY {block};
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
            RETURN QUERY {hash};
        END
        $$;
"""


def _function(name: str, held: str, extra: str) -> str:
    return _FUNCTION.format(
        name=name,
        extra=extra,
        block=_BLOCK_RUNS.format(held=held).strip().rstrip(";"),
        hash=_HASH_RUNS.format(held=held).strip().rstrip(";"),
    )


def _revision_0003() -> ModuleType:
    path = Path(__file__).with_name("0003_match_tokens_reader.py")
    spec = importlib.util.spec_from_file_location("kvledger_revision_0003", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# match_tokens walks full blocks, then partial-tail hashes: its matched_blocks is capped at
# the full blocks of the walk, so a tail adds tokens only.
_TOKENS_FINAL_SELECT = """
            SELECT m.instance, m.medium, m.ownership,
                   least(m.matched_blocks, (SELECT count(*) FROM chain))::integer,
                   m.matched_tokens
            FROM kvledger.match_prefix(
                p_model, p_group,
                ARRAY(SELECT h FROM (SELECT h, i AS k FROM chain
                                     UNION ALL SELECT h, 1000000000 + j FROM tail) s
                      ORDER BY k, h)) m
"""

_GRANT = """
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
    op.execute(
        """
        DROP FUNCTION kvledger.match_tokens(text, integer, integer[], text);
        DROP FUNCTION kvledger.match_prefix(text, integer, bytea[]);
        DROP FUNCTION kvledger.match_prefix_at(text, integer, bytea[], timestamptz);
        """
        + _function("match_prefix", _HELD_NOW, "")
        + _function("match_prefix_at", _HELD_AT, ", p_at timestamptz")
        + _revision_0003().match_tokens_sql(_TOKENS_FINAL_SELECT)
        + _GRANT
    )


def downgrade() -> None:
    # The three-argument, block-granularity forms of revisions 0002 and 0003.
    old = _revision_0003()
    op.execute(
        """
        DROP FUNCTION kvledger.match_tokens(text, integer, integer[], text);
        DROP FUNCTION kvledger.match_prefix(text, integer, bytea[], text);
        DROP FUNCTION kvledger.match_prefix_at(text, integer, bytea[], timestamptz, text);
        """
        + _old_function("match_prefix", _HELD_NOW, "")
        + _old_function("match_prefix_at", _HELD_AT, ", p_at timestamptz")
        + old.match_tokens_sql(old.FINAL_SELECT)
        + _GRANT
    )


def _old_function(name: str, held: str, extra: str) -> str:
    return f"""
        CREATE FUNCTION kvledger.{name}(p_model text, p_group integer, p_hashes bytea[]{extra})
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        BEGIN
            RETURN QUERY {_BLOCK_RUNS.format(held=held).strip().rstrip(";")};
        END
        $$;
        """
