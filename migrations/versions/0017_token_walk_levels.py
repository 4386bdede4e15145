"""Token walks count levels, not blocks: two hashes of one content both hold it.

A token walk finds, at each level, every block holding the prompt's next tokens under a
block of the level before. Two engines that hash one content differently (vLLM and SGLang
side by side, vLLM's xxhash variants, engines with different PYTHONHASHSEEDs) store two
chains of the same tokens, so a level has a block of each. ``held_tokens`` handed the
levels' blocks to ``held_prefix`` as one list of positions, so each holder's run stopped
at the other engine's block: the first engine matched one block, the second none. Now:

- a holder holds a level when it holds any of its blocks; its run counts levels, and its
  matched tokens are the furthest end of the blocks it holds at its last level;
- the partial tails go on from every block of the last full level, and the full levels'
  count (not the blocks') bounds matched_blocks.

The router's walk (rust/src/group/content.rs, serving/router/groups.py) counts the same.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-01
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_UPGRADE = r"""
CREATE OR REPLACE FUNCTION kvledger.held_tokens(p_model text, p_group integer, p_tokens integer[],
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
            top AS (
                SELECT coalesce(max(c.i), 0) AS n, coalesce(max(c.i), 0) * spec.block_size AS pos
                FROM spec LEFT JOIN chain c ON true
                GROUP BY spec.block_size
            ),
            tail(h, j, pos) AS (
                SELECT b.block_hash, 1, top.pos + spec.hash_block_size
                FROM top, spec, kvledger.blocks b
                WHERE b.model = p_model AND b.group_idx = p_group
                  AND CASE WHEN top.n = 0 THEN b.parent_hash IS NULL
                           ELSE b.parent_hash IN (SELECT c.h FROM chain c WHERE c.i = top.n) END
                  AND b.partial AND b.block_size = spec.hash_block_size
                  AND top.pos + spec.hash_block_size <= cardinality(p_tokens)
                  AND b.token_ids = p_tokens[top.pos + 1:top.pos + spec.hash_block_size]
                  AND b.lora_name IS NOT DISTINCT FROM p_lora
                  AND CASE WHEN top.n = 0 THEN kvledger.first_under(b.extra_keys, p_salt)
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
            ),
            levels(h, k) AS (
                SELECT c.h, c.i FROM chain c
                UNION ALL
                SELECT t.h, top.n + t.j FROM tail t, top
            ),
            held AS MATERIALIZED (
                SELECT DISTINCT r.instance, r.medium, r.ownership, l.k
                FROM levels l
                JOIN kvledger.residencies r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = l.h
            ),
            numbered AS (
                SELECT held.instance, held.medium, held.ownership, held.k,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.k) AS rn
                FROM held
            ),
            runs AS (
                SELECT n.instance, n.medium, n.ownership, max(n.k) AS k
                FROM numbered n WHERE n.k = n.rn
                GROUP BY n.instance, n.medium, n.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership,
                   least(runs.k, top.n)::integer,
                   -- the furthest end of the blocks the holder holds at its last level
                   (SELECT max(b.token_end)
                    FROM levels l
                    JOIN kvledger.residencies r
                      ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = l.h
                     AND r.instance = runs.instance AND r.medium = runs.medium
                     AND r.ownership = runs.ownership
                    JOIN kvledger.blocks b
                      ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = l.h
                    WHERE l.k = runs.k)
            FROM runs CROSS JOIN top

        $function$;
"""

# The function as revision 0015 made it.
_DOWNGRADE = r"""
CREATE OR REPLACE FUNCTION kvledger.held_tokens(p_model text, p_group integer, p_tokens integer[],
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
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
