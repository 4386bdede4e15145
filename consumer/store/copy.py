"""PostgreSQL binary COPY: rows in without text escaping (the store's fast path)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import psycopg

from kvledger.consumer.store.tables import Column


def int4_array(values: Sequence[int]) -> bytes:
    """PostgreSQL's binary form of an int4[] in one struct.pack call.

    Binary COPY hands a field's bytes to the column type's receive function, so these bytes
    go out through the plain bytea dumper (see tables.BLOCKS): far cheaper than adapting a
    Python list element by element.
    """
    n = len(values)
    if n == 0:  # an empty array has no dimensions
        return struct.pack(">iiI", 0, 0, 23)
    body = [4] * (2 * n)  # (length 4, value) per element
    body[1::2] = values
    # ndim 1, no nulls, element oid 23 (int4), length n, lower bound 1, elements.
    return struct.pack(f">iiIii{2 * n}i", 1, 0, 23, n, 1, *body)


def copy_rows(
    cur: psycopg.Cursor,
    table: str,
    columns: Sequence[Column],
    rows: Sequence[Sequence[object]],
) -> None:
    """Binary COPY of rows into a table."""
    if not rows:
        return
    names = ", ".join(name for name, _ in columns)
    with cur.copy(f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types([kind for _, kind in columns])
        for row in rows:
            copy.write_row(row)
