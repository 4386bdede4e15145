"""tests/helpers/local_only.py: a test run aimed at services off this machine is named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.local_only import bootstrap_hosts, remote_services


def test_loopback_and_sockets_are_local_and_the_rest_is_named() -> None:
    local = {
        "KVLEDGER_KAFKA_BOOTSTRAP": "127.0.0.1:19092,localhost:9092,[::1]:9093",
        "KVLEDGER_DATABASE_URL": "postgresql+psycopg://u:p@127.0.0.1:15432/kvledger",
        "KVLEDGER_ADMIN_DATABASE_URL": "postgresql+psycopg://u@/kvledger?host=/run/postgresql",
    }
    assert remote_services(local) == []
    remote = dict(local, KVLEDGER_KAFKA_BOOTSTRAP="127.0.0.1:19092,broker1:9092",
                  KVLEDGER_LOOKUP_DATABASE_URL="postgresql://r:p@10.0.0.5/kvledger")  # fmt: skip
    assert remote_services(remote) == [
        "KVLEDGER_KAFKA_BOOTSTRAP=broker1",
        "KVLEDGER_LOOKUP_DATABASE_URL=10.0.0.5",
    ]
    assert bootstrap_hosts("SSL://b:9093, [fe80::1]:9092,c") == ["b", "fe80::1", "c"]


@pytest.mark.parametrize("allowed", [False, True])
def test_a_run_aimed_off_this_machine_refuses_to_start_unless_allowed(allowed: bool) -> None:
    env = {"PATH": "/usr/bin:/bin", "KVLEDGER_KAFKA_BOOTSTRAP": "broker1.example:9092"}
    if allowed:
        env["KVLEDGER_TESTS_ALLOW_REMOTE"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "tests/unit/test_local_only.py"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if allowed:
        assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-1000:]
    else:
        assert run.returncode == 2 and "KVLEDGER_TESTS_ALLOW_REMOTE=1" in run.stdout + run.stderr
