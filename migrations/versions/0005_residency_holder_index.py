"""The residencies' per-holder index carries the whole key.

An index on (instance, medium, ownership) alone was the planner's pick for the consumer's
per-key joins (DELETE ... USING tmp_res, the preload) whenever statistics were missing or
stale, as on a fresh index: every probe then walked all of a holder's residencies and
their dead versions (about 0.1 ms each, 200 ms per batch under churn). With the whole key
in it, either index answers a key probe with one entry, and per-holder scans (an
AllBlocksCleared, footprints) still use its prefix.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Built concurrently (outside the migration's transaction): on a large live index the
    # consumer and the lookups go on meanwhile. A build interrupted earlier leaves an invalid
    # index of that name: dropped first.
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS kvledger.residencies_holder_idx")
        op.execute(
            "CREATE INDEX CONCURRENTLY residencies_holder_idx ON kvledger.residencies "
            "(instance, medium, ownership, model, group_idx, block_hash)"
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS kvledger.residencies_instance_idx")


def downgrade() -> None:
    op.execute(
        """
        DROP INDEX kvledger.residencies_holder_idx;
        CREATE INDEX residencies_instance_idx ON kvledger.residencies (instance, medium, ownership);
        """
    )
