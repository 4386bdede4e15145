"""The lookup functions' readable definitions (serving/lookup/sql/*.sql) are exactly what
the newest migration creates."""

from __future__ import annotations

from importlib import resources

import pytest

from kvledger.consumer.db import connect

pytestmark = pytest.mark.integration


def _file_definitions() -> dict[str, str]:
    folder = resources.files("kvledger.serving.lookup").joinpath("sql")
    out = {}
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            lines = entry.read_text("utf-8").splitlines(keepends=True)
            body = "".join(line for line in lines if not line.startswith("-- "))
            out[entry.name.removesuffix(".sql")] = body.rstrip("\n")
    return out


def test_sql_files_equal_the_migrated_functions(fresh_database: str) -> None:
    with connect(fresh_database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'kvledger'"
        ).fetchall()
    migrated = {name: definition.rstrip("\n") for name, definition in rows}
    files = _file_definitions()
    assert set(files) == set(migrated)
    assert {"match_prefix", "match_prefix_at", "match_tokens", "source_state"} <= set(files)
    for name, definition in migrated.items():
        assert files[name] == definition, f"serving/lookup/sql/{name}.sql differs"
