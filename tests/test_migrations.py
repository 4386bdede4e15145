"""Every migration goes down and comes back up on a real PostgreSQL server."""

from __future__ import annotations

import pytest

from kvledger.consumer.db import connect, downgrade, migrate

pytestmark = pytest.mark.integration


def _objects(url: str) -> tuple[set[str], set[str]]:
    with connect(url, autocommit=True) as conn:
        tables = {
            name
            for (name,) in conn.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'kvledger' AND c.relkind IN ('r', 'p', 'v') "
                "AND NOT c.relispartition"
            )
        }
        functions = {
            str(sig)
            for (sig,) in conn.execute(
                "SELECT p.proname || '(' || oidvectortypes(p.proargtypes) || ')' "
                "FROM pg_proc p "
                "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'kvledger'"
            )
        }
    return tables, functions


def test_downgrade_each_revision_and_upgrade_again(fresh_database: str) -> None:
    head_tables, head_functions = _objects(fresh_database)
    assert {"blocks", "residencies", "events", "instance_footprint"} <= head_tables
    assert "match_prefix(text, integer, bytea[], text, boolean, interval)" in head_functions
    assert "source_states(interval)" in head_functions
    assert {"sources", "lifecycle_events", "restarts", "source_status"} <= head_tables

    downgrade(fresh_database, "0007")
    tables, functions = _objects(fresh_database)
    assert "match_prefix(text, integer, bytea[], text)" in functions
    assert not {"sources", "lifecycle_events", "restarts", "source_status"} & tables
    with connect(fresh_database, autocommit=True) as conn:  # 0007's match_tokens runs again
        assert (
            conn.execute("SELECT * FROM kvledger.match_tokens('m', 0, ARRAY[1, 2, 3])").fetchall()
            == []
        )

    downgrade(fresh_database, "0003")
    _, functions = _objects(fresh_database)
    assert "match_prefix(text, integer, bytea[])" in functions
    assert "match_tokens(text, integer, integer[], text)" in functions
    with connect(fresh_database, autocommit=True) as conn:  # the 0003 functions still run
        assert (
            conn.execute("SELECT * FROM kvledger.match_tokens('m', 0, ARRAY[1, 2, 3])").fetchall()
            == []
        )

    for revision in ("0002", "0001", "base"):
        downgrade(fresh_database, revision)
    tables, functions = _objects(fresh_database)
    assert not tables and not functions

    migrate(fresh_database)
    assert _objects(fresh_database) == (head_tables, head_functions)


def test_a_migration_does_not_queue_behind_a_live_index(
    fresh_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader holds a table the next revision alters: the migration fails within its lock
    timeout (it does not wait, with every later query queued behind it), and succeeds once
    the reader is done."""
    import time

    import sqlalchemy as sa

    downgrade(fresh_database, "0009")
    monkeypatch.setenv("KVLEDGER_MIGRATION_LOCK_TIMEOUT", "1s")
    with connect(fresh_database) as reader:
        reader.execute("SELECT count(*) FROM kvledger.lifecycle_events").fetchone()  # holds it
        start = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
            migrate(fresh_database)
        assert time.monotonic() - start < 30
        reader.rollback()
    migrate(fresh_database)
    with connect(fresh_database, autocommit=True) as conn:
        row = conn.execute("SELECT version_num FROM kvledger_migrations.version").fetchone()
    assert row is not None and row[0] >= "0010"


def test_the_version_table_is_kvledgers_own(fresh_database: str) -> None:
    """kvledger_migrations.version, not public.alembic_version: a table of ours left there by
    an older release moves on the next migrate; another application's is left alone."""
    with connect(fresh_database, autocommit=True) as conn:
        head = conn.execute("SELECT version_num FROM kvledger_migrations.version").fetchone()
        assert conn.execute("SELECT to_regclass('public.alembic_version')").fetchone() == (None,)
        # As an older release left it.
        conn.execute("ALTER TABLE kvledger_migrations.version SET SCHEMA public")
        conn.execute("ALTER TABLE public.version RENAME TO alembic_version")
    migrate(fresh_database)
    with connect(fresh_database, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('public.alembic_version')").fetchone() == (None,)
        moved = conn.execute("SELECT version_num FROM kvledger_migrations.version").fetchone()
        assert moved == head
        # Another Alembic-managed application's table: not ours, not touched.
        conn.execute("CREATE TABLE public.alembic_version (version_num varchar(32) PRIMARY KEY)")
        conn.execute("INSERT INTO public.alembic_version VALUES ('ae1027a6acf')")
    migrate(fresh_database)
    with connect(fresh_database, autocommit=True) as conn:
        other = conn.execute("SELECT version_num FROM public.alembic_version").fetchone()
        ours = conn.execute("SELECT version_num FROM kvledger_migrations.version").fetchone()
    assert other == ("ae1027a6acf",) and ours == head
