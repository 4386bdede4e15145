"""Prefix runs without sorting: a holder whose positions are 1..max is settled by counting.

A holder's run is the longest stretch of positions 1, 2, ... it holds. Revisions 0002/0004
ranked every held position with a window function, which sorts all of them; here one hash
aggregate gives each holder's count, smallest and largest position, and a holder whose
count equals its largest position (and that starts at 1) holds exactly 1..max. Only holders
with gaps are ranked. Same answers; on a 1.7-million-residency index the server time of a
128-hash lookup went from about 720 to 550 microseconds (measured side by side).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _revision_0004() -> ModuleType:
    path = Path(__file__).with_name("0004_match_hash_granularity.py")
    spec = importlib.util.spec_from_file_location("kvledger_revision_0004", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# runs(instance, medium, ownership, n) from held(instance, medium, ownership, i), where
# (holder, i) is unique: whole runs by counting, runs with gaps by ranking.
_RUNS = """
            WITH held AS MATERIALIZED ({held}),
            agg AS (
                SELECT held.instance, held.medium, held.ownership, count(*) AS c,
                       min(held.i) AS lo, max(held.i) AS hi
                FROM held
                GROUP BY held.instance, held.medium, held.ownership
            ),
            gapped AS (
                SELECT held.instance, held.medium, held.ownership, held.i,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.i) AS rn
                FROM held
                JOIN agg ON agg.instance = held.instance AND agg.medium = held.medium
                        AND agg.ownership = held.ownership
                WHERE agg.lo = 1 AND agg.c <> agg.hi
            ),
            runs AS (
                SELECT agg.instance, agg.medium, agg.ownership, agg.hi AS n
                FROM agg WHERE agg.lo = 1 AND agg.c = agg.hi
                UNION ALL
                SELECT gapped.instance, gapped.medium, gapped.ownership, max(gapped.i)
                FROM gapped WHERE gapped.i = gapped.rn
                GROUP BY gapped.instance, gapped.medium, gapped.ownership
            )"""

_BLOCK_ANSWER = """
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n]"""

_HASH_ANSWER = """
            SELECT runs.instance, runs.medium, runs.ownership,
                   (runs.n / v_ratio)::integer, runs.n::bigint * v_hash_size
            FROM runs"""

# Positions covered at hash granularity: a held hash, and the positions of a block whose
# last hash (the block's own) is held.
_COVERED = """
                SELECT DISTINCT h.instance, h.medium, h.ownership, c.i
                FROM ({held}) h CROSS JOIN LATERAL generate_series(
                    CASE WHEN h.i % v_ratio = 0 THEN h.i - v_ratio + 1 ELSE h.i END,
                    h.i) AS c(i)"""


def _function(old: ModuleType, name: str, held: str, extra: str) -> str:
    """Revision 0004's function (its granularity switch), with the runs counted."""
    return str(
        old._FUNCTION.format(
            name=name,
            extra=extra,
            block=(_RUNS.format(held=held) + _BLOCK_ANSWER).strip(),
            hash=(_RUNS.format(held=_COVERED.format(held=held)) + _HASH_ANSWER).strip(),
        )
    )


_DROP = """
        DROP FUNCTION kvledger.match_prefix(text, integer, bytea[], text);
        DROP FUNCTION kvledger.match_prefix_at(text, integer, bytea[], timestamptz, text);
"""


def upgrade() -> None:
    old = _revision_0004()
    op.execute(
        _DROP
        + _function(old, "match_prefix", old._HELD_NOW, "")
        + _function(old, "match_prefix_at", old._HELD_AT, ", p_at timestamptz")
        + old._GRANT
    )


def downgrade() -> None:
    old = _revision_0004()
    op.execute(
        _DROP
        + old._function("match_prefix", old._HELD_NOW, "")
        + old._function("match_prefix_at", old._HELD_AT, ", p_at timestamptz")
        + old._GRANT
    )
