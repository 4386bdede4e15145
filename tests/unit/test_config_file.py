"""kvledger/config_file.py (issue 48's item 22): settings from a TOML file, under the
environment and the command line, each key checked against the options that read it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.cli import build_parser
from kvledger.config_file import ConfigFileError, check, load
from kvledger.envopts import known

FILE = """
kafka-bootstrap = "broker1:9092"
[consume]
batch-size = 2000
until-caught-up = true
[relay]
group = ["0:full_attention:16", "1:sliding_window:16"]
[groups.declare]
model = "m"
"""


def test_the_file_fills_what_the_environment_does_not_hold(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(FILE)
    env = {"KVLEDGER_CONFIG": str(tmp_path / "c.toml"), "KVLEDGER_CONSUME_BATCH_SIZE": "7"}
    found, named = load(env)
    assert found == tmp_path / "c.toml"
    assert env["KVLEDGER_CONSUME_BATCH_SIZE"] == "7"  # the environment wins
    assert env["KVLEDGER_KAFKA_BOOTSTRAP"] == "broker1:9092"
    assert env["KVLEDGER_CONSUME_UNTIL_CAUGHT_UP"] == "true"
    assert env["KVLEDGER_RELAY_GROUP"] == "0:full_attention:16,1:sliding_window:16"
    assert env["KVLEDGER_GROUPS_DECLARE_MODEL"] == "m"
    check(found, named, known(build_parser()))  # every key is read by some option


def test_the_users_file_is_read_when_present(tmp_path: Path) -> None:
    assert load({"XDG_CONFIG_HOME": str(tmp_path)}) == (None, [])
    (tmp_path / "kvledger").mkdir()
    (tmp_path / "kvledger" / "config.toml").write_text("[serve]\nport = 9001\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    assert load(env)[0] is not None and env["KVLEDGER_SERVE_PORT"] == "9001"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[consume]\nbatch-sise = 3\n", "did you mean $KVLEDGER_CONSUME_BATCH_SIZE"),
        ("[consume\n", "is not TOML"),
        ("[serve]\nport = 1979-05-27\n", "is not a setting's value"),
        # Hostile files: a key no variable can be named, nesting past any command's.
        ('"kafka=bootstrap" = "h:1"\n', "a key is letters, digits"),
        ("a" + ".a" * 20_000 + " = 1\n", "nest"),
        ("[" + ".".join(["t"] * 3_000) + "]\n", "nest"),
        ("x = " + "[" * 5_000 + "]" * 5_000 + "\n", "nest"),
        ("[serve]\nport = [[1]]\n", "is not a setting's value"),
    ],
)
def test_a_file_no_command_can_read_is_refused_in_one_line(
    tmp_path: Path, text: str, why: str
) -> None:
    (tmp_path / "c.toml").write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "kvledger", "status"], capture_output=True, text=True,
        env={"KVLEDGER_CONFIG": str(tmp_path / "c.toml"), "PATH": "/usr/bin:/bin"},
        timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 2 and why in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("variable", ["KVLEDGER_CONFIG", "KVLEDGER_DATABASE_URL_FILE"])
def test_an_endless_file_is_refused_in_one_line(variable: str) -> None:
    """/dev/zero as the config file or a secret: read to a bound (1 MiB), then refused."""
    run = subprocess.run(
        [sys.executable, "-m", "kvledger", "sources"], capture_output=True, text=True,
        env={variable: "/dev/zero", "PATH": "/usr/bin:/bin"}, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert "/dev/zero" in run.stderr and "1 MiB" in run.stderr, run.stderr


def test_a_flag_wins_over_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "c.toml").write_text("[consume]\nbatch-size = 2000\n")
    monkeypatch.setenv("KVLEDGER_CONFIG", str(tmp_path / "c.toml"))
    monkeypatch.delenv("KVLEDGER_CONSUME_BATCH_SIZE", raising=False)
    try:
        load()
        parser = build_parser()
    finally:  # what load() put in this process's environment goes with the test
        os.environ.pop("KVLEDGER_CONSUME_BATCH_SIZE", None)
    assert parser.parse_args(["consume"]).batch_size == 2000
    assert parser.parse_args(["consume", "--batch-size", "5"]).batch_size == 5
    with pytest.raises(ConfigFileError):
        check(tmp_path, [("KVLEDGER_NOPE", "nope")], known(parser))


def test_planning_ahead_is_the_consumers_default_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvledger.consumer_cmds import consumer_config

    monkeypatch.delenv("KVLEDGER_CONSUME_NO_PLAN_AHEAD", raising=False)
    parser = build_parser()
    url = ["--database-url", "postgresql+psycopg://u@h:1/d", "--bootstrap", "127.0.0.1:1"]
    assert consumer_config(parser.parse_args(["consume", *url])).plan_ahead
    off = parser.parse_args(["consume", *url, "--no-plan-ahead"])
    assert not consumer_config(off).plan_ahead
    monkeypatch.setenv("KVLEDGER_CONSUME_NO_PLAN_AHEAD", "true")
    assert not build_parser().parse_args(["consume", *url]).plan_ahead
