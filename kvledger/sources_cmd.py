"""`kvledger sources`: every source's life as the index follows it."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import timedelta
from typing import TYPE_CHECKING

from kvledger import settings
from kvledger.consumer.admin import list_sources
from kvledger.consumer.db import connect
from kvledger.tables import print_table

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "sources",
        help="every source: live, silent, closed or restarted; epoch, last seen, gaps, blocks",
    )
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")
    p.add_argument(
        "--silent-after",
        type=float,
        help="seconds without a message after which a source is silent (else the "
        "database's kvledger.silent_after, 30 s by default)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per source, as a list")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    window = timedelta(seconds=args.silent_after) if args.silent_after else None
    with connect(settings.database_url(args.database_url), autocommit=True) as conn:
        sources = list_sources(conn, window)
    if args.json:
        print(json.dumps([asdict(s) for s in sources], default=str, indent=2))
        return 0
    print_table(
        ("source", "model", "state", "epoch", "last seen", "restarts", "gaps", "GPU", "CPU",
         "STORAGE"),
        [(s.source, s.model, s.state, s.epoch, f"{s.last_seen:%Y-%m-%d %H:%M:%S}", s.restarts,
          s.gaps, s.held["GPU"], s.held["CPU"], s.held["STORAGE"]) for s in sources],
    )  # fmt: skip
    return 0
