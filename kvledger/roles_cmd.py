"""`kvledger roles create-reader`: the read-only login the lookup service uses."""

from __future__ import annotations

import argparse
import sys

from kvledger import files, settings
from kvledger.options import ENV_ADMIN
from kvledger.options import ENV_READER_PASSWORD as ENV_PASSWORD


def create_reader_cmd(args: argparse.Namespace) -> int:
    from kvledger.consumer.roles import create_reader

    owner = settings.database_url(args.database_url)
    admin = args.admin_database_url or settings.from_env(ENV_ADMIN) or owner
    if args.password_file:
        try:
            password = files.first_line(args.password_file, strip=False)
        except (OSError, ValueError) as exc:  # FileTooLargeError, UnicodeDecodeError
            raise SystemExit(f"kvledger roles: cannot read the password file: {exc}") from None
    else:
        password = settings.from_env(ENV_PASSWORD) or ""
    if not password:
        raise SystemExit(
            f"kvledger roles: no password: pass --password-file or set ${ENV_PASSWORD}"
        )
    import psycopg

    try:
        granted = create_reader(admin, owner, password, args.name, args.reset_password)
    except ValueError as exc:
        raise SystemExit(f"kvledger roles: {exc}") from None
    except psycopg.errors.InsufficientPrivilege:
        who = "the index's owner" if admin == owner else "the admin URL's role"
        raise SystemExit(
            f"kvledger roles: {who} may not create roles: pass --admin-database-url (or set "
            f"${ENV_ADMIN}) with a role that has CREATEROLE, such as the server's superuser"
        ) from None
    what = "password reset" if args.reset_password else "created"
    print(f"role {args.name} {what}: login, member of kvledger_reader (read-only)", file=sys.stderr)
    if not granted:
        print("no index schema yet: `kvledger migrate` grants the reads", file=sys.stderr)
    return 0
