"""Alembic environment: the URL is set by the caller (kvledger migrate) or the environment.

Every migration runs with a lock timeout (KVLEDGER_MIGRATION_LOCK_TIMEOUT, default 10s): a
migration that needs a table the consumer or the lookups hold fails with a clear error
instead of queueing behind them, and in front of every later query on that table.

The version table is kvledger's own, ``kvledger_migrations.version``, not Alembic's default
``public.alembic_version`` (which any other Alembic-managed application in the database
would share). A database migrated before that has its table moved there on the next run,
when the revision in it is one of ours.
"""

from __future__ import annotations

import os

from alembic import context
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, create_engine, event, pool

VERSION_SCHEMA = "kvledger_migrations"
VERSION_TABLE = "version"

config = context.config
url = config.get_main_option("sqlalchemy.url") or os.environ.get("KVLEDGER_DATABASE_URL")
if not url:
    raise SystemExit("migrations: set KVLEDGER_DATABASE_URL or pass the URL to kvledger migrate")


def run_migrations_offline() -> None:
    context.configure(
        url=url,
        literal_binds=True,
        version_table=VERSION_TABLE,
        version_table_schema=VERSION_SCHEMA,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(url, poolclass=pool.NullPool)
    lock_timeout = os.environ.get("KVLEDGER_MIGRATION_LOCK_TIMEOUT", "10s")

    @event.listens_for(engine, "connect")
    def _bounded(dbapi_connection: object, _: object) -> None:
        with dbapi_connection.cursor() as cur:  # type: ignore[attr-defined]
            cur.execute("SELECT set_config('lock_timeout', %s, false)", (lock_timeout,))
        dbapi_connection.commit()  # type: ignore[attr-defined]

    with engine.connect() as connection:
        _own_version_table(connection)
        context.configure(
            connection=connection,
            version_table=VERSION_TABLE,
            version_table_schema=VERSION_SCHEMA,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


def _own_version_table(connection: Connection) -> None:
    """Create the version table's schema; move a legacy public.alembic_version of ours."""
    run = connection.exec_driver_sql
    run(f"CREATE SCHEMA IF NOT EXISTS {VERSION_SCHEMA}")
    legacy = run(
        "SELECT to_regclass('public.alembic_version') IS NOT NULL "
        f"AND to_regclass('{VERSION_SCHEMA}.{VERSION_TABLE}') IS NULL"
    ).scalar()
    if legacy:
        ours = {s.revision for s in ScriptDirectory.from_config(config).walk_revisions()}
        held = set(run("SELECT version_num FROM public.alembic_version").scalars())
        if held and held <= ours:
            run(f"ALTER TABLE public.alembic_version SET SCHEMA {VERSION_SCHEMA}")
            run(f"ALTER TABLE {VERSION_SCHEMA}.alembic_version RENAME TO {VERSION_TABLE}")
    connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
