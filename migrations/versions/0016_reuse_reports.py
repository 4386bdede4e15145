"""A source may announce the blocks it reuses as stores; the index records that it does.

vLLM's ``kv_cache_report_mode="full"`` makes an engine re-announce the prefix blocks a
request reuses from its cache as ``BlockStored``, in the same shape as a real store. A
source that says so (``GroupSpec.reports_reuse``, ``kvledger relay --report-mode full``)
has a store of a block it already holds on that medium applied as a report: no second
reference. The flag is kept per stream, beside the source's restart policy:

- source_health.reports_reuse (false for every stream until its source announces it).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE kvledger.source_health "
        "ADD COLUMN reports_reuse boolean NOT NULL DEFAULT false"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE kvledger.source_health DROP COLUMN reports_reuse")
