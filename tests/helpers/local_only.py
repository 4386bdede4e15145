"""Which of the services a test run is pointed at are not on this machine (pure).

The tests create and drop topics, consumer groups and databases of their own, but a run
aimed at a shared broker or server by a stray variable should not start without being told
to (``KVLEDGER_TESTS_ALLOW_REMOTE=1``): tests/conftest.py refuses it at start.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

ALLOW = "KVLEDGER_TESTS_ALLOW_REMOTE"
# The variables that aim tests at services: the broker, and every database URL.
VARIABLES = ("KVLEDGER_KAFKA_BOOTSTRAP", "KVLEDGER_DATABASE_URL",
             "KVLEDGER_LOOKUP_DATABASE_URL", "KVLEDGER_ADMIN_DATABASE_URL")  # fmt: skip


def is_local(host: str | None) -> bool:
    """A host of this machine: none (a Unix socket), localhost, or a loopback address."""
    if not host or host.lower() in {"localhost", "localhost.localdomain", "ip6-localhost"}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bootstrap_hosts(value: str) -> list[str]:
    """The hosts of a bootstrap list (``host:port,[v6]:port,…``, a scheme allowed)."""
    hosts = []
    for entry in value.split(","):
        item = entry.strip().split("://")[-1]
        if item.startswith("["):
            hosts.append(item[1 : item.find("]")])
        elif item:
            hosts.append(item.rsplit(":", 1)[0] if ":" in item else item)
    return hosts


def remote_services(env: Mapping[str, str]) -> list[str]:
    """``VARIABLE=host`` for each service ``env`` names off this machine."""
    out = []
    for name in VARIABLES:
        value = env.get(name)
        if not value:
            continue
        if name == "KVLEDGER_KAFKA_BOOTSTRAP":
            hosts = bootstrap_hosts(value)
        else:
            try:
                hosts = [urlsplit(value).hostname or ""]
            except ValueError:
                hosts = ["(unreadable URL)"]
        out += [f"{name}={h}" for h in hosts if not is_local(h)]
    return out
