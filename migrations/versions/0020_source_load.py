"""The engine's load on its source row: what its relay read from the engine's metrics.

A relay that reads its engine's load sends it in heartbeats (``requests_running``,
``requests_waiting``, contract 0.3.0); the index keeps the latest on ``kvledger.sources``
with the log time of the heartbeat that carried it (``load_at``). A restart, a goodbye or
another model clears the three. Lookups answer it beside the holders, so a router can break
a tie by load without counting requests itself.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE kvledger.sources
            ADD COLUMN requests_running integer CHECK (requests_running >= 0),
            ADD COLUMN requests_waiting integer CHECK (requests_waiting >= 0),
            ADD COLUMN load_at timestamptz
        """
    )


def downgrade() -> None:
    op.execute(
        """
        ALTER TABLE kvledger.sources
            DROP COLUMN requests_running,
            DROP COLUMN requests_waiting,
            DROP COLUMN load_at
        """
    )
