"""Settings read from the environment, once, at the edge (CLI)."""

from __future__ import annotations

import os

ENV_KAFKA = "KVLEDGER_KAFKA_BOOTSTRAP"
ENV_DATABASE = "KVLEDGER_DATABASE_URL"


def kafka_bootstrap(flag: str | None) -> str:
    value = flag or os.environ.get(ENV_KAFKA)
    if not value:
        raise SystemExit(
            f"kvledger: no Kafka broker: pass --bootstrap or set {ENV_KAFKA} "
            '(`eval "$(scripts/services env)"` after `scripts/services up`)'
        )
    return value


def database_url(flag: str | None) -> str:
    value = flag or os.environ.get(ENV_DATABASE)
    if not value:
        raise SystemExit(
            f"kvledger: no database: pass --database-url or set {ENV_DATABASE} "
            '(`eval "$(scripts/services env)"` after `scripts/services up`)'
        )
    return value
