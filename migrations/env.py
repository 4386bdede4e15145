"""Alembic environment: the URL is set by the caller (kvledger migrate) or the environment.

Every migration runs with a lock timeout (KVLEDGER_MIGRATION_LOCK_TIMEOUT, default 10s): a
migration that needs a table the consumer or the lookups hold fails with a clear error
instead of queueing behind them, and in front of every later query on that table.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, event, pool

config = context.config
url = config.get_main_option("sqlalchemy.url") or os.environ.get("KVLEDGER_DATABASE_URL")
if not url:
    raise SystemExit("migrations: set KVLEDGER_DATABASE_URL or pass the URL to kvledger migrate")


def run_migrations_offline() -> None:
    context.configure(url=url, literal_binds=True, version_table="alembic_version")
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
        context.configure(connection=connection, version_table="alembic_version")
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
