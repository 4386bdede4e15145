"""Settings read from the environment, once, at the edge (CLI)."""

from __future__ import annotations

import os

ENV_KAFKA = "KVLEDGER_KAFKA_BOOTSTRAP"
ENV_DATABASE = "KVLEDGER_DATABASE_URL"


def _required(flag: str | None, env: str, what: str, option: str) -> str:
    value = flag or os.environ.get(env)
    if not value:
        raise SystemExit(
            f"kvledger: no {what}: pass {option} or set {env} "
            '(`eval "$(scripts/services env)"` after `scripts/services up`)'
        )
    return value


def kafka_bootstrap(flag: str | None) -> str:
    return _required(flag, ENV_KAFKA, "Kafka broker", "--bootstrap")


def database_url(flag: str | None) -> str:
    return _required(flag, ENV_DATABASE, "database", "--database-url")
