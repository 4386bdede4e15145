"""kvledger on an authenticated cluster: a broker with one SASL_SSL listener (TLS, SCRAM)
and the standard authorizer (scripts/services' sasl_ssl mode), users and ACLs made with the
admin's client. The whole pipeline runs as a principal with the right ACLs; one without
them, and one with a wrong password, get a clear error quickly, never a hang."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from kvledger.consumer.db import connect
from kvledger.settings import read_properties
from tests.helpers.kafka import private_kafka

pytestmark = pytest.mark.integration

PREFIX = "sec-"
TOPIC, DLQ, GROUP = "sec-events", "sec-events-dlq", "sec-index"


def _user(admin: AdminClient, name: str, password: str) -> None:
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
    upsert = UserScramCredentialUpsertion(name, info, password.encode())
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result(timeout=30)


def _allow_all_prefixed(admin: AdminClient, principal: str) -> None:
    acls = [
        AclBinding(kind, PREFIX, ResourcePatternType.PREFIXED, principal, "*",
                   AclOperation.ALL, AclPermissionType.ALLOW)
        for kind in (ResourceType.TOPIC, ResourceType.GROUP, ResourceType.TRANSACTIONAL_ID)
    ]  # fmt: skip
    for future in admin.create_acls(acls).values():
        future.result(timeout=30)


def _client_config(path: Path, admin_conf: dict[str, str], user: str, password: str) -> str:
    path.write_text(
        f"bootstrap.servers={admin_conf['bootstrap.servers']}\n"
        "security.protocol=SASL_SSL\nsasl.mechanisms=SCRAM-SHA-512\n"
        f"sasl.username={user}\nsasl.password={password}\n"
        f"ssl.ca.location={admin_conf['ssl.ca.location']}\n"
    )
    path.chmod(0o600)
    return str(path)


def _kvledger(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVLEDGER_KAFKA_BOOTSTRAP"}
    return subprocess.run(
        [sys.executable, "-m", "kvledger", *args],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_the_pipeline_on_an_authenticated_cluster(fresh_database: str, tmp_path: Path) -> None:
    with private_kafka(tmp_path / "state", security="sasl_ssl") as broker:
        assert broker.admin_config is not None
        # What scripts/services leaves on disk is the running user's alone.
        kafka_dir = Path(broker.admin_config).parent
        for path in (kafka_dir, kafka_dir / "tls"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        for path in (kafka_dir / "server.properties", Path(broker.admin_config)):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

        admin_conf = read_properties(broker.admin_config)
        admin = AdminClient(dict(admin_conf))
        _user(admin, "app", "app-secret")
        _user(admin, "intruder", "intruder-secret")
        _allow_all_prefixed(admin, "User:app")
        app = _client_config(tmp_path / "app.properties", admin_conf, "app", "app-secret")
        intruder = _client_config(
            tmp_path / "intruder.properties", admin_conf, "intruder", "intruder-secret"
        )
        wrong = _client_config(tmp_path / "wrong.properties", admin_conf, "app", "not-it")

        # The right principal: simulate → topic, a poison message → the dead-letter topic,
        # consume → index, verify → the index equals a replay of the topic.
        done = _kvledger("simulate", "--kafka-config", app, "--topic", TOPIC, "--requests", "15")
        assert done.returncode == 0, done.stderr
        poison = Producer(dict(read_properties(app)))
        poison.produce(TOPIC, key=b"x", value=b"\x00not a kvledger message")
        assert poison.flush(30) == 0
        common = ["--kafka-config", app, "--topic", TOPIC, "--database-url", fresh_database]
        done = _kvledger(
            "consume", *common, "--consumer-group", GROUP, "--dlq-topic", DLQ, "--until-caught-up",
            "--no-migrate",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "1 rejected" in done.stdout, done.stdout
        with connect(fresh_database, autocommit=True) as conn:
            blocks = conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone()
        assert blocks is not None and blocks[0] > 0
        dead = _kvledger("dlq", "list", "--database-url", fresh_database, "--json")
        assert dead.returncode == 0 and "undecodable" in dead.stdout, dead.stdout
        done = _kvledger("verify", *common, "--consumer-group", GROUP)
        assert done.returncode == 0, done.stdout + done.stderr

        # No ACL: refused at once, with what is missing, not retried forever.
        for command in (
            ["simulate", "--kafka-config", intruder, "--topic", TOPIC, "--requests", "2"],
            ["consume", "--kafka-config", intruder, "--topic", TOPIC, "--database-url",
             fresh_database, "--consumer-group", f"{PREFIX}x", "--dlq-topic", DLQ,
             "--until-caught-up", "--no-migrate"],
        ):  # fmt: skip
            start = time.monotonic()
            done = _kvledger(*command, timeout=120)
            assert done.returncode == 1, (command[0], done.stdout, done.stderr)
            assert "AUTHORIZATION_FAILED" in done.stderr, done.stderr
            assert time.monotonic() - start < 60
        # A wrong password: an error that says so, within the start-up timeout.
        done = _kvledger(
            "consume", "--kafka-config", wrong, "--topic", TOPIC, "--database-url",
            fresh_database, "--consumer-group", GROUP, "--dlq-topic", DLQ, "--until-caught-up",
            "--no-migrate", timeout=120,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert "credentials" in done.stderr or "uthentication" in done.stderr, done.stderr
        # Nothing the intruder tried reached the index.
        with connect(fresh_database, autocommit=True) as conn:
            after = conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone()
        assert after == blocks
