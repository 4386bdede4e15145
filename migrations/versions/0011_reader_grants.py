"""The read-only role's grants, whole, and for what later revisions create.

Revision 0003 made kvledger_reader only where the migrating role could create roles, and
granted in the same block as adding itself to the role (which needs admin rights on it):
an owner without CREATEROLE got no grant at all. Roles are now made by the operator (`kvledger
roles create-reader`, or scripts/services); this revision grants, when the role exists:
usage of the schema, SELECT on every table and view, EXECUTE on every function, and the
same by default for tables and functions the owner creates later.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_UPGRADE = r"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
        GRANT USAGE ON SCHEMA kvledger TO kvledger_reader;
        GRANT SELECT ON ALL TABLES IN SCHEMA kvledger TO kvledger_reader;
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA kvledger TO kvledger_reader;
        ALTER DEFAULT PRIVILEGES IN SCHEMA kvledger GRANT SELECT ON TABLES TO kvledger_reader;
        ALTER DEFAULT PRIVILEGES IN SCHEMA kvledger
            GRANT EXECUTE ON FUNCTIONS TO kvledger_reader;
    END IF;
END
$$;
"""

_DOWNGRADE = r"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvledger_reader') THEN
        ALTER DEFAULT PRIVILEGES IN SCHEMA kvledger REVOKE SELECT ON TABLES FROM kvledger_reader;
        ALTER DEFAULT PRIVILEGES IN SCHEMA kvledger
            REVOKE EXECUTE ON FUNCTIONS FROM kvledger_reader;
    END IF;
END
$$;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
