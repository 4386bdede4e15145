"""Settings read from the environment, once, at the edge (CLI)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from kvledger import files

if TYPE_CHECKING:
    from kvledger.schemas.codec import Codec

ENV_KAFKA = "KVLEDGER_KAFKA_BOOTSTRAP"
ENV_DATABASE = "KVLEDGER_DATABASE_URL"
ENV_LOOKUP_DATABASE = "KVLEDGER_LOOKUP_DATABASE_URL"


def from_env(name: str) -> str | None:
    """``$NAME``, else the first line of the file ``$NAME_FILE`` names (the convention of
    container secrets: a password-bearing value need not sit in the environment)."""
    if value := os.environ.get(name):
        return value
    if path := os.environ.get(f"{name}_FILE"):
        try:
            return files.first_line(path) or None
        except (OSError, ValueError) as exc:  # FileTooLargeError, UnicodeDecodeError
            raise SystemExit(f"kvledger: cannot read ${name}_FILE: {exc}") from None
    return None


def _required(flag: str | None, env: str, what: str, option: str) -> str:
    value = flag or from_env(env)
    if not value:
        raise SystemExit(
            f"kvledger: no {what}: pass {option} or set {env} (or {env}_FILE) "
            '(`eval "$(scripts/services env)"` after `scripts/services up`)'
        )
    return value


def kafka_bootstrap(args: argparse.Namespace) -> str:
    """--bootstrap, else $KVLEDGER_KAFKA_BOOTSTRAP, else the Kafka settings' bootstrap.servers."""
    flag = getattr(args, "bootstrap", None) or from_env(ENV_KAFKA)
    if not flag and hasattr(args, "kafka_config"):
        flag = kafka_settings(args).get("bootstrap.servers")
    bootstrap = _required(flag, ENV_KAFKA, "Kafka broker", "--bootstrap")
    if (why := unresolved(bootstrap)) is not None:
        raise SystemExit(f"kvledger: {why}: check --bootstrap (or ${ENV_KAFKA})")
    return bootstrap


def unresolved(bootstrap: str) -> str | None:
    """Why no host of ``bootstrap`` (``host:port,...``) can be reached by name: each one's
    name does not resolve (the client would only say "no broker answered", 10 to 20 s
    later); None when one resolves (or names an address)."""
    import socket

    reasons = []
    for entry in bootstrap.split(","):
        address = entry.strip().split("://")[-1]  # a listener's name before it, if any
        host = (address.rpartition(":")[0] or address).strip("[]")
        if not host:
            continue
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return None
        except socket.gaierror as exc:
            reasons.append(f"{host!r} does not resolve ({exc.strerror})")
        except (UnicodeError, ValueError):
            reasons.append(f"{host!r} is not a host name")
    return "Kafka bootstrap " + "; ".join(reasons) if reasons else None


def database_url(flag: str | None) -> str:
    return _required(flag, ENV_DATABASE, "database", "--database-url")


def lookup_database_url(flag: str | None) -> str:
    """The lookup service's URL: the flag, else $KVLEDGER_LOOKUP_DATABASE_URL (a read-only
    role), else $KVLEDGER_DATABASE_URL (which `kvledger serve` then refuses if its role can
    write, unless --allow-writer)."""
    found = flag or from_env(ENV_LOOKUP_DATABASE) or from_env(ENV_DATABASE)
    if not found:
        raise SystemExit(
            f"kvledger: no database: pass --database-url, or set {ENV_LOOKUP_DATABASE} (a "
            "read-only role: `kvledger roles create-reader`) or else "
            f"{ENV_DATABASE} (refused if its role can write, unless --allow-writer); "
            '`eval "$(scripts/services env)"` sets both'
        )
    return found


ENV_KAFKA_CONFIG = "KVLEDGER_KAFKA_CONFIG"


def kafka_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings of --kafka-config (or $KVLEDGER_KAFKA_CONFIG), then --kafka-set."""
    path = getattr(args, "kafka_config", None) or os.environ.get(ENV_KAFKA_CONFIG)
    out = read_properties(path) if path else {}
    for item in getattr(args, "kafka_set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"kvledger: --kafka-set wants KEY=VALUE, not {item!r}")
        out[key.strip()] = value.strip()
    return out


def read_properties(path: str) -> dict[str, str]:
    """A properties file: ``key=value`` (or ``key: value``) lines; ``#`` and ``!`` comment."""
    try:
        lines = files.read_text(path).splitlines()
    except (OSError, ValueError) as exc:  # FileTooLargeError, UnicodeDecodeError
        raise SystemExit(f"kvledger: cannot read the Kafka settings {path}: {exc}") from None
    out: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if cut < 0:
            raise SystemExit(f"kvledger: {path}:{number}: expected key=value")
        out[line[:cut].strip()] = line[cut + 1 :].strip()
    return out


ENV_REGISTRY = "KVLEDGER_SCHEMA_REGISTRY"
ENV_REGISTRY_CONFIG = "KVLEDGER_SCHEMA_REGISTRY_CONFIG"


def codec(args: argparse.Namespace, topic: str, writer: bool) -> Codec | None:
    """The codec for --schema-registry (None without one: the default framing). A writer
    registers under the subject of ``topic``; a reader never registers."""
    from kvledger.schemas.codec import Codec
    from kvledger.schemas.registry import RegistryUnavailableError, open_registry, subject_for

    url = getattr(args, "schema_registry", None) or from_env(ENV_REGISTRY)
    if not url:
        return None
    path = getattr(args, "schema_registry_config", None) or from_env(ENV_REGISTRY_CONFIG)
    registry = open_registry(url, read_properties(path) if path else None)
    strategy = (
        getattr(args, "subject_strategy", None)
        or os.environ.get("KVLEDGER_SUBJECT_STRATEGY")
        or "topic"
    )
    try:
        return Codec(registry=registry, subject=subject_for(topic, strategy) if writer else None)
    except RegistryUnavailableError as exc:  # say which registry, and where it was set
        raise RegistryUnavailableError(
            f"{exc} (at {_without_password(url)}: check --schema-registry or ${ENV_REGISTRY})"
        ) from exc


def _without_password(url: str) -> str:
    """``url`` without the user and password it may carry (``https://user:pw@host``)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if parts.username is None and parts.password is None:
            return url
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        return parts._replace(netloc=netloc).geturl()
    except ValueError:  # an unparsable port: say nothing of it
        return "the registry's URL"
