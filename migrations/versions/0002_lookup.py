"""Lookup functions: longest-prefix match by hashes, now and as of a past time.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        -- For each holder (instance, medium, ownership) with a non-empty match: the longest
        -- run of consecutive hashes from the start of p_hashes that it holds now, in blocks,
        -- and the tokens it covers (the end of the last matched block). PL/pgSQL so that the
        -- plan is cached per session.
        CREATE FUNCTION kvledger.match_prefix(p_model text, p_group integer, p_hashes bytea[])
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        BEGIN
            RETURN QUERY
            WITH held AS (
                SELECT r.instance, r.medium, r.ownership, q.i::integer AS i,
                       row_number() OVER (PARTITION BY r.instance, r.medium, r.ownership
                                          ORDER BY q.i) AS rn
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residencies r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
            ),
            runs AS (
                SELECT held.instance, held.medium, held.ownership, max(held.i) AS n
                FROM held WHERE held.i = held.rn
                GROUP BY held.instance, held.medium, held.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
        END
        $$;

        -- The same answer as of a past instant, from the residency history.
        CREATE FUNCTION kvledger.match_prefix_at(p_model text, p_group integer,
                                                 p_hashes bytea[], p_at timestamptz)
        RETURNS TABLE (instance text, medium text, ownership text,
                       matched_blocks integer, matched_tokens bigint)
        LANGUAGE plpgsql STABLE AS $$
        BEGIN
            RETURN QUERY
            WITH held AS (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)
            ),
            ranked AS (
                SELECT held.*, row_number() OVER (PARTITION BY held.instance, held.medium,
                                                  held.ownership ORDER BY held.i) AS rn
                FROM held
            ),
            runs AS (
                SELECT ranked.instance, ranked.medium, ranked.ownership, max(ranked.i) AS n
                FROM ranked WHERE ranked.i = ranked.rn
                GROUP BY ranked.instance, ranked.medium, ranked.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
        END
        $$;

        -- Auditors' views.
        CREATE VIEW kvledger.instance_footprint AS
            SELECT r.model, r.group_idx, r.instance, r.medium, r.ownership,
                   count(*) AS blocks, sum(r.refcount) AS refs,
                   sum(b.block_size) AS tokens
            FROM kvledger.residencies r
            LEFT JOIN kvledger.blocks b USING (model, group_idx, block_hash)
            GROUP BY r.model, r.group_idx, r.instance, r.medium, r.ownership;

        CREATE VIEW kvledger.rejected_summary AS
            SELECT reason, count(*) AS total,
                   count(*) FILTER (WHERE replayed_at IS NULL) AS pending,
                   min(first_seen) AS first_seen, max(first_seen) AS last_seen
            FROM kvledger.rejected_events GROUP BY reason;

        CREATE VIEW kvledger.residency_timeline AS
            SELECT model, group_idx, block_hash, instance, medium, ownership, locality,
                   stored_at, removed_at, removed_by,
                   coalesce(removed_at, now()) - stored_at AS held_for
            FROM kvledger.residency_history;

        CREATE VIEW kvledger.hottest_prefixes AS
            SELECT b.model, b.group_idx, b.block_hash, b.token_start, b.token_end,
                   count(DISTINCT r.instance) AS instances, count(*) AS residencies
            FROM kvledger.blocks b
            JOIN kvledger.residencies r USING (model, group_idx, block_hash)
            WHERE b.block_size > 0
            GROUP BY b.model, b.group_idx, b.block_hash, b.token_start, b.token_end;
        """
    )


def downgrade() -> None:
    op.execute(
        """
        DROP VIEW IF EXISTS kvledger.hottest_prefixes;
        DROP VIEW IF EXISTS kvledger.residency_timeline;
        DROP VIEW IF EXISTS kvledger.rejected_summary;
        DROP VIEW IF EXISTS kvledger.instance_footprint;
        DROP FUNCTION IF EXISTS kvledger.match_prefix_at(text, integer, bytea[], timestamptz);
        DROP FUNCTION IF EXISTS kvledger.match_prefix(text, integer, bytea[]);
        """
    )
