"""Alembic environment: the URL is set by the caller (kvledger migrate) or the environment."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

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
    with engine.connect() as connection:
        context.configure(connection=connection, version_table="alembic_version")
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
