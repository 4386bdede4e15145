"""Database connections and migrations."""

from __future__ import annotations

from importlib import resources
from types import ModuleType
from typing import TYPE_CHECKING

import psycopg

from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.redact import redact

if TYPE_CHECKING:
    from alembic.config import Config


# The schemes of a PostgreSQL URL: libpq's own, and SQLAlchemy's with a driver named.
_SCHEMES = frozenset({"postgresql", "postgres"})
URL_FORM = "postgresql+psycopg://USER@HOST:PORT/DATABASE, a password after USER:"


class DatabaseUrlError(KvledgerError, ValueError):
    """A database URL kvledger cannot use; the message never shows its password."""


def conninfo(url: str) -> str:
    """A libpq URL from a SQLAlchemy one (postgresql+psycopg:// → postgresql://).

    Anything but a PostgreSQL URL raises :class:`DatabaseUrlError`, which shows the URL with
    its password cut (libpq's and the drivers' own errors would print it whole)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise DatabaseUrlError(f"not a database URL ({URL_FORM}): {redact(url)!r}")
    if scheme.split("+", 1)[0].lower() not in _SCHEMES:
        raise DatabaseUrlError(f"not a PostgreSQL URL ({URL_FORM}): {redact(url)!r}")
    return f"{scheme.split('+', 1)[0]}://{rest}"


SCHEMA_MISSING = "the index schema is missing (or older than this kvledger): run `kvledger migrate`"


class SchemaMissingError(KvledgerError):
    """The database has no kvledger index schema (or an older one): run `kvledger migrate`."""

    def __init__(self) -> None:
        super().__init__(SCHEMA_MISSING)


# What a database that `kvledger migrate` never ran on (or ran on with an older kvledger)
# answers when asked for the index's tables and functions, and kvledger's own word for it.
SCHEMA_MISSING_ERRORS: tuple[type[Exception], ...] = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.InvalidSchemaName,
    SchemaMissingError,
)


def connect(url: str, autocommit: bool = False) -> psycopg.Connection:
    return psycopg.connect(conninfo(url), autocommit=autocommit)


def _alembic(url: str) -> tuple[ModuleType, Config]:
    conninfo(url)  # a URL that is not PostgreSQL's is refused here, its password hidden
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


def current_revision(url: str) -> str | None:
    """The index schema's migration revision (None: never migrated)."""
    with connect(url, autocommit=True) as conn:
        found = conn.execute("SELECT to_regclass('kvledger_migrations.version')").fetchone()
        if found is None or found[0] is None:
            return None
        row = conn.execute("SELECT version_num FROM kvledger_migrations.version").fetchone()
    return None if row is None else str(row[0])


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
