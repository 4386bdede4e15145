"""PostgreSQL binary COPY: rows in without text escaping (the store's fast path)."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg

from kvledger.consumer.store.tables import Column


def copy_rows(
    cur: psycopg.Cursor,
    table: str,
    columns: Sequence[Column],
    rows: Sequence[Sequence[object]],
) -> None:
    """Binary COPY of rows into a table."""
    if not rows:
        return
    with cur.copy(_copy_in(table, columns)) as copy:
        copy.set_types([kind for _, kind in columns])
        for row in rows:
            copy.write_row(row)


def copy_data(cur: psycopg.Cursor, table: str, columns: Sequence[Column], data: bytes) -> None:
    """Binary COPY of data already in PostgreSQL's binary COPY format (signature, rows,
    trailer), as the compiled core writes a plan's block rows and residencies."""
    with cur.copy(_copy_in(table, columns)) as copy:
        copy.write(data)


def _copy_in(table: str, columns: Sequence[Column]) -> str:
    return f"COPY {table} ({', '.join(name for name, _ in columns)}) FROM STDIN (FORMAT BINARY)"
