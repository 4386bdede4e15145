"""Kafka client settings for every client a command opens: file, environment, overrides."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvledger.arguments import add_kafka_args
from kvledger.settings import kafka_settings, read_properties


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kafka_args(parser)
    return parser.parse_args(argv)


def test_properties_file_environment_and_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    props = tmp_path / "client.properties"
    props.write_text(
        "# the cluster's settings\n! also a comment\n\nsecurity.protocol=SASL_SSL\n"
        "sasl.mechanism: SCRAM-SHA-512\nsasl.password = a=b:c\n"
    )
    assert read_properties(str(props)) == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.password": "a=b:c",
    }  # fmt: skip
    monkeypatch.setenv("KVLEDGER_KAFKA_CONFIG", str(props))
    got = kafka_settings(_args(["--kafka-set", "sasl.mechanism=PLAIN", "--kafka-set", "x=1"]))
    assert got["sasl.mechanism"] == "PLAIN" and got["x"] == "1"
    assert got["security.protocol"] == "SASL_SSL"
    monkeypatch.delenv("KVLEDGER_KAFKA_CONFIG")
    assert kafka_settings(_args([])) == {}


def test_malformed_settings_say_where(tmp_path: Path) -> None:
    bad = tmp_path / "bad.properties"
    bad.write_text("ok=1\njust words\n")
    with pytest.raises(SystemExit, match=r"bad.properties:2: expected key=value"):
        read_properties(str(bad))
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        kafka_settings(_args(["--kafka-set", "novalue"]))


@pytest.mark.parametrize("read", ["token", "password", "properties", "token ids"])
def test_a_secret_or_settings_file_is_read_to_a_bound(read: str) -> None:
    """/dev/zero (endless, no line end) wherever a file is named: refused in one line once
    its bound is read, never read whole."""
    from kvledger import lookup_cmds, roles_cmd

    with pytest.raises(SystemExit) as refused:
        if read == "token":
            lookup_cmds._token("/dev/zero")
        elif read == "password":
            args = argparse.Namespace(
                database_url="postgresql+psycopg://u@h:1/d",
                admin_database_url=None,
                password_file="/dev/zero",
            )
            roles_cmd.create_reader_cmd(args)
        elif read == "properties":
            read_properties("/dev/zero")
        else:
            lookup_cmds.parse_token_ids("@/dev/zero")
    assert "/dev/zero" in str(refused.value) and "MiB" in str(refused.value)


def test_the_lookup_service_without_a_database_names_what_it_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve` reads $KVLEDGER_LOOKUP_DATABASE_URL first and refuses a role that can write:
    its error says so, not only --database-url and $KVLEDGER_DATABASE_URL."""
    from kvledger.settings import lookup_database_url

    for name in ("KVLEDGER_LOOKUP_DATABASE_URL", "KVLEDGER_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"{name}_FILE", raising=False)
    with pytest.raises(SystemExit) as refused:
        lookup_database_url(None)
    said = str(refused.value)
    assert "KVLEDGER_LOOKUP_DATABASE_URL" in said and "read-only" in said
    assert "--allow-writer" in said
    monkeypatch.setenv("KVLEDGER_DATABASE_URL", "postgresql+psycopg://u@h/d")
    assert lookup_database_url(None) == "postgresql+psycopg://u@h/d"
