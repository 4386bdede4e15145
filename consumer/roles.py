"""Database roles: the read-only role the lookup service logs in as.

Two roles: ``kvledger_reader`` (no login) holds the read grants — usage of the schema,
SELECT on its tables and views, EXECUTE on its functions, and the same by default for what
later migrations create — and a login role of the operator's naming (``kvledger_lookup``
by default) is a member of it. The owner (the consumer's role) grants; creating roles takes
a role with CREATEROLE (the "admin" URL), so the owner itself needs none.

The password is sent as a SCRAM-SHA-256 verifier computed here, so the server (its
statement log included) never sees it in clear.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re

import psycopg
from psycopg import sql

from kvledger.consumer.db import SchemaMissingError, connect
from kvledger.schemas.errors import KvledgerError

READER_GROUP = "kvledger_reader"
DEFAULT_LOGIN = "kvledger_lookup"

# What the group role may do (migration 0011 runs the same grants when the role exists).
GRANT_READS = """
GRANT USAGE ON SCHEMA kvledger TO kvledger_reader;
GRANT SELECT ON ALL TABLES IN SCHEMA kvledger TO kvledger_reader;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA kvledger TO kvledger_reader;
ALTER DEFAULT PRIVILEGES IN SCHEMA kvledger GRANT SELECT ON TABLES TO kvledger_reader;
ALTER DEFAULT PRIVILEGES IN SCHEMA kvledger GRANT EXECUTE ON FUNCTIONS TO kvledger_reader;
"""

# True when the connection's role could change the index: a superuser, a member of the
# schema's owner, or any write privilege on one of its tables.
_CAN_WRITE = """
SELECT r.rolsuper
    OR pg_has_role(current_user, n.nspowner, 'USAGE')
    OR has_schema_privilege('kvledger', 'CREATE')
    OR EXISTS (
        SELECT 1 FROM pg_tables t
        WHERE t.schemaname = 'kvledger'
          AND has_table_privilege(
                format('%I.%I', t.schemaname, t.tablename), 'INSERT, UPDATE, DELETE, TRUNCATE'))
FROM pg_roles r, pg_namespace n
WHERE r.rolname = current_user AND n.nspname = 'kvledger'
"""

_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class WriterRoleError(KvledgerError):
    """A read-only service was given a role that can write to the index."""


class RoleExistsError(KvledgerError):
    """The login role exists already and was not to be given a new password."""


def scram_verifier(password: str, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677)."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    b64 = base64.b64encode

    def s(b: bytes) -> str:
        return b64(b).decode()

    stored = hashlib.sha256(client_key).digest()
    return f"SCRAM-SHA-256${iterations}:{s(salt)}${s(stored)}:{s(server_key)}"


def can_write(conn: psycopg.Connection) -> bool:
    """Whether the connection's role could change the index (see ``_CAN_WRITE``)."""
    row = conn.execute(_CAN_WRITE).fetchone()
    if row is None:
        raise SchemaMissingError
    return bool(row[0])


def ensure_read_only(url: str) -> None:
    """Raise :class:`WriterRoleError` when the role ``url`` logs in as could write."""
    with connect(url, autocommit=True) as conn:
        writer = can_write(conn)
        row = conn.execute("SELECT current_user").fetchone()
    if writer:
        raise WriterRoleError(
            f"the database role {row[0] if row else '?'} can write to the index: log in as a "
            "read-only role (`kvledger roles create-reader`, then "
            "$KVLEDGER_LOOKUP_DATABASE_URL) or pass --allow-writer"
        )


def create_reader(
    admin_url: str,
    owner_url: str,
    password: str,
    name: str = DEFAULT_LOGIN,
    reset_password: bool = False,
) -> bool:
    """Create the login role ``name``, a member of kvledger_reader, with the admin's
    connection; then grant the reads with the owner's. A role that exists already raises
    :class:`RoleExistsError` unless ``reset_password`` (then it gets ``password``, and the
    logins that use its old one stop working). False when the owner's database has no
    index schema yet (the migration grants then)."""
    if not _NAME.match(name):
        raise ValueError(f"role name {name!r}: lowercase letters, digits and _ only")
    if not password:
        raise ValueError("the reader's password is empty")
    verifier = scram_verifier(password)
    ident = sql.Identifier(name)
    with connect(admin_url) as conn, conn.transaction():
        conn.execute(
            "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'kvledger_reader') "
            "THEN CREATE ROLE kvledger_reader NOLOGIN; END IF; END $$"
        )
        row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (name,)).fetchone()
        if row is not None and row[0]:
            raise ValueError(f"role {name!r} is a superuser: it cannot be a read-only login")
        if row is not None and not reset_password:
            raise RoleExistsError(
                f"role {name} exists already: pass --reset-password to give it this password "
                "(logins with its old one then fail), or name another role"
            )
        # ALTER names no SUPERUSER attribute: only a superuser may, and an admin with
        # CREATEROLE alone may re-run this command.
        template = (
            "ALTER ROLE {} LOGIN NOCREATEDB NOCREATEROLE PASSWORD {}"
            if row is not None
            else "CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD {}"
        )
        conn.execute(sql.SQL(template).format(ident, sql.Literal(verifier)))
        conn.execute(sql.SQL("GRANT kvledger_reader TO {}").format(ident))
    with connect(owner_url) as conn, conn.transaction():
        if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'kvledger'").fetchone() is None:
            return False
        conn.execute(GRANT_READS)
    return True
