"""Database connections and migrations."""

from __future__ import annotations

from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]


def conninfo(url: str) -> str:
    """A libpq URL from a SQLAlchemy one (postgresql+psycopg:// → postgresql://)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a database URL: {url!r}")
    return f"{scheme.split('+', 1)[0]}://{rest}"


def connect(url: str, autocommit: bool = False) -> psycopg.Connection:
    return psycopg.connect(conninfo(url), autocommit=autocommit)


def migrate(url: str, revision: str = "head") -> None:
    """Run Alembic's upgrade to ``revision`` (the project's migrations/)."""
    from alembic import command
    from alembic.config import Config

    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(ROOT / "migrations"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.upgrade(config, revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command
    from alembic.config import Config

    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(ROOT / "migrations"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.downgrade(config, revision)
