"""Database connections and migrations."""

from __future__ import annotations

from importlib import resources
from types import ModuleType
from typing import TYPE_CHECKING

import psycopg

if TYPE_CHECKING:
    from alembic.config import Config


def conninfo(url: str) -> str:
    """A libpq URL from a SQLAlchemy one (postgresql+psycopg:// → postgresql://)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a database URL: {url!r}")
    return f"{scheme.split('+', 1)[0]}://{rest}"


def connect(url: str, autocommit: bool = False) -> psycopg.Connection:
    return psycopg.connect(conninfo(url), autocommit=autocommit)


def _alembic(url: str) -> tuple[ModuleType, Config]:
    from alembic import command
    from alembic.config import Config

    # The migrations ship inside the package (kvledger/migrations), installed or editable.
    with resources.as_file(resources.files("kvledger").joinpath("migrations")) as folder:
        config = Config(str(folder / "alembic.ini"))
        config.set_main_option("script_location", str(folder))
        config.set_main_option("version_locations", str(folder / "versions"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return command, config


def migrate(url: str, revision: str = "head") -> None:
    """Run Alembic's upgrade to ``revision`` (the project's migrations/)."""
    command, config = _alembic(url)
    command.upgrade(config, revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Run Alembic's downgrade to ``revision``."""
    command, config = _alembic(url)
    command.downgrade(config, revision)


def drop_database(server_url: str, name: str, attempts: int = 10) -> None:
    """Drop a database, waiting out autovacuum (which FORCE may not terminate without
    pg_signal_backend) and ending our own leftover sessions."""
    import time

    for attempt in range(attempts):
        with connect(server_url, autocommit=True) as conn:
            try:
                # Plain DROP makes autovacuum workers on that database exit by themselves.
                conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
                return
            except psycopg.errors.ObjectInUse:
                try:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                    return
                except psycopg.errors.InsufficientPrivilege:
                    if attempt == attempts - 1:
                        raise
        time.sleep(0.5)


def create_database(server_url: str, name: str, replace: bool = False) -> str:
    """Create a database on the server of ``server_url``; returns its SQLAlchemy URL."""
    import sqlalchemy as sa

    if replace:
        drop_database(server_url, name)
    with connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return sa.engine.make_url(server_url).set(database=name).render_as_string(hide_password=False)
