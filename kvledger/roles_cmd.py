"""`kvledger roles create-reader`: the read-only login the lookup service uses."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvledger import settings

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

ENV_ADMIN = "KVLEDGER_ADMIN_DATABASE_URL"
ENV_PASSWORD = "KVLEDGER_READER_PASSWORD"


def add_parser(subparsers: Subparsers) -> None:
    roles = subparsers.add_parser(
        "roles",
        help="database roles",
        description="Database roles: the index's owner (the consumer) and a read-only login "
        "for the lookup service.",
    )
    sub = roles.add_subparsers(dest="roles_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "create-reader",
        help="create (or re-password) the lookup service's read-only login",
        description="Create the login role NAME (or set its password), a member of "
        "kvledger_reader, which may read the index and call its lookup functions and nothing "
        "else; then grant the reads as the owner. The password is read from a file or the "
        "environment, never from the command line, and is sent as a SCRAM verifier.",
    )
    p.add_argument("name", nargs="?", default="kvledger_lookup", help="the login role's name")
    p.add_argument(
        "--password-file",
        help=f"the password, first line of this file (else ${ENV_PASSWORD} or "
        f"${ENV_PASSWORD}_FILE)",
    )
    p.add_argument(
        "--admin-database-url",
        help=f"a role that may create roles (else ${ENV_ADMIN}, else the owner's URL)",
    )
    p.add_argument(
        "--database-url", help="the index owner's URL, which grants (else $KVLEDGER_DATABASE_URL)"
    )
    p.set_defaults(run=_create_reader)


def _create_reader(args: argparse.Namespace) -> int:
    from kvledger.consumer.roles import create_reader

    owner = settings.database_url(args.database_url)
    admin = args.admin_database_url or settings.from_env(ENV_ADMIN) or owner
    if args.password_file:
        try:
            with open(args.password_file, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n")
        except OSError as exc:
            raise SystemExit(f"kvledger roles: cannot read the password file: {exc}") from None
    else:
        password = settings.from_env(ENV_PASSWORD) or ""
    if not password:
        raise SystemExit(
            f"kvledger roles: no password: pass --password-file or set ${ENV_PASSWORD}"
        )
    try:
        granted = create_reader(admin, owner, password, args.name)
    except ValueError as exc:
        raise SystemExit(f"kvledger roles: {exc}") from None
    print(f"role {args.name}: login, member of kvledger_reader (read-only)", file=sys.stderr)
    if not granted:
        print("no index schema yet: `kvledger migrate` grants the reads", file=sys.stderr)
    return 0
