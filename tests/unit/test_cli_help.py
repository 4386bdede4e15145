"""The command explains itself: every subcommand and option has help, and the usual
failures are one line, not a traceback."""

from __future__ import annotations

import argparse

import pytest

from kvledger.cli import build_parser, main


def _walk(parser: argparse.ArgumentParser, path: list[str]) -> list[tuple[str, str, str]]:
    """(command, option or subcommand, its help) for everything the parser offers."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((" ".join(path), name, helps.get(name, "")))
                out += _walk(sub, [*path, name])
        elif action.option_strings and action.dest != "help" and action.help != argparse.SUPPRESS:
            out.append((" ".join(path), action.option_strings[0], action.help or ""))
    return out


def test_every_subcommand_and_option_has_help() -> None:
    offered = _walk(build_parser(), ["kvledger"])
    assert len(offered) > 100
    assert [(cmd, name) for cmd, name, text in offered if not text.strip()] == []


def test_an_unreachable_database_is_one_line_with_no_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "postgresql+psycopg://kv:s3cret@127.0.0.1:1/db"
    assert main(["sources", "--database-url", url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvledger sources: database: ")
    assert "s3cret" not in err and "Traceback" not in err


def _parse(argv: list[str], monkeypatch: pytest.MonkeyPatch, **env: str) -> argparse.Namespace:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv)


def test_every_option_names_its_environment_variable() -> None:
    offered = _walk(build_parser(), ["kvledger"])
    options = [
        (cmd, name, text)
        for cmd, name, text in offered
        if name.startswith("-") and name != "--version"
    ]
    assert len(options) > 80
    unnamed = [(c, n) for c, n, t in options if "[env KVLEDGER_" not in t and "$KVLEDGER_" not in t]
    assert unnamed == []
    consume = {n: t for c, n, t in options if c == "kvledger consume"}
    assert "[env KVLEDGER_CONSUME_BATCH_SIZE; default 5000]" in consume["--batch-size"]


def test_a_variable_sets_an_option_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parse(["consume"], monkeypatch, KVLEDGER_CONSUME_BATCH_SIZE="77",
                  KVLEDGER_CONSUME_UNTIL_CAUGHT_UP="true",
                  KVLEDGER_CONSUME_CONSUMER_GROUP="idx-2")  # fmt: skip
    assert (args.batch_size, args.until_caught_up, args.group) == (77, True, "idx-2")
    assert _parse(["consume", "--batch-size", "9"], monkeypatch).batch_size == 9
    # A required option can come from its variable; a repeated one takes a list.
    relay = _parse(
        ["relay", "--source", "e0"], monkeypatch,
        KVLEDGER_RELAY_ENDPOINT="tcp://127.0.0.1:5557", KVLEDGER_RELAY_MODEL="m",
        KVLEDGER_RELAY_GROUP="0:full_attention:16,1:sliding_window:16",
    )  # fmt: skip
    assert relay.endpoint == "tcp://127.0.0.1:5557" and relay.model == "m"
    assert relay.group == ["0:full_attention:16", "1:sliding_window:16"]
    nested = _parse(["groups", "declare", "--group", "1", "--block-size", "16"], monkeypatch,
                    KVLEDGER_GROUPS_DECLARE_MODEL="llama")  # fmt: skip
    assert nested.model == "llama"
    assert _parse(["lookup", "--model", "m", "--token-ids", "1"], monkeypatch,
                  KVLEDGER_DEBUG="yes").verbose is True  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [("KVLEDGER_CONSUME_BATCH_SIZE", "many", "not a valid value"),
     ("KVLEDGER_CONSUME_UNTIL_CAUGHT_UP", "maybe", "expected true or false"),
     ("KVLEDGER_LOG_FORMAT", "xml", "not one of text, json")],
)  # fmt: skip
def test_a_bad_variable_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str,
    says: str,
) -> None:  # fmt: skip
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        build_parser()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"${name}" in err and says in err


def test_every_subcommand_describes_itself() -> None:
    parser = build_parser()
    assert "configuration is read here" not in parser.format_help()
    for argv in (["consume"], ["dlq", "list"], ["roles", "create-reader"], ["relay"]):
        sub = parser
        for word in argv:
            action = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
            sub = action.choices[word]
        assert sub.description, argv


def test_json_logs_are_one_object_a_line_without_passwords(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json
    import logging

    from kvledger.cli import JsonFormatter

    record = logging.LogRecord(
        "kvledger.x", logging.WARNING, __file__, 1,
        "cannot reach postgresql+psycopg://kv:s3cret@db/x", None, None,
    )  # fmt: skip
    line = JsonFormatter().format(record)
    data = json.loads(line)
    assert data["level"] == "WARNING" and data["logger"] == "kvledger.x"
    assert "s3cret" not in line and "kv:***@db" in data["message"]


def test_no_parser_takes_an_abbreviation(capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix of one option is never taken for it: `consume --group G` once became
    `--group-instance-id G`."""
    from kvledger.parsers import walk

    parsers = list(walk(build_parser()))
    assert len(parsers) > 15 and all(p.allow_abbrev is False for p in parsers)
    for argv, says in (
        (["consume", "--group", "G"], "--consumer-group names the Kafka consumer group"),
        (["consume", "--until-caughtup"], "did you mean --until-caught-up?"),
        (["lookup", "--modle", "m", "--token-ids", "1"], "did you mean --model?"),
        (["relay", "--endp", "tcp://x:1", "--source", "s", "--model", "m"], "--endp"),
        (["groups"], "a command is required: one of declare, list"),
        (["consum"], "did you mean consume?"),
    ):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert says in err, (argv, err)
        if argv[0] in ("consume", "lookup"):  # the command's own usage, not the top level's
            assert f"usage: kvledger {argv[0]} " in err


def test_help_imports_no_server_dependency_and_defaults_match() -> None:
    import subprocess
    import sys

    probe = (
        "import sys; from kvledger.cli import build_parser; p = build_parser(); "
        "p.format_help(); [a for a in p._actions]; "
        "heavy = {'sqlalchemy', 'psycopg', 'alembic', 'starlette', 'uvicorn', 'zmq', "
        "'msgspec', 'prometheus_client', 'confluent_kafka', 'fastavro'}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.strip() == "[]"
    from kvledger import fleet, options
    from kvledger.producer import config
    from kvledger.producer.relay import config as relay_config
    from kvledger.schemas import topics

    assert options.DEFAULT_TOPIC == config.DEFAULT_TOPIC
    assert options.DEFAULT_PARTITIONS == topics.DEFAULT_PARTITIONS
    assert options.ENGINES == relay_config.ENGINES
    assert options.DEFAULT_MODEL == fleet.DEFAULT_MODEL


def test_a_missing_extra_is_named_when_the_command_runs() -> None:
    """On the base install `serve --port` is parsed, and running it names the extra."""
    import subprocess
    import sys

    probe = (
        "import sys; sys.modules['starlette'] = None; sys.modules['uvicorn'] = None; "
        "from kvledger.cli import main; "
        "sys.exit(main(['serve', '--port', '9', '--database-url', 'postgresql://h/x']))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "pip install 'kvledger[lookup]'" in done.stderr and "Traceback" not in done.stderr


def test_relay_help_states_each_default_once() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["relay"].format_help()  # type: ignore[union-attr]
    assert "(default:" not in text and "default 1]" in text


@pytest.mark.parametrize(
    "url", ["kvledger:s3cretpw@127.0.0.1:25432/kvledger", "mysql://u:s3cretpw@h/x"]
)
def test_a_malformed_database_url_never_shows_its_password(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sources", "--database-url", url]) == 1
    err = capsys.readouterr().err
    assert "s3cretpw" not in err and "Traceback" not in err and err.count("\n") == 1
    assert "not a" in err and "URL" in err


def test_token_ids_from_a_missing_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["lookup", "--model", "m", "--token-ids", "@/nonexistent/ids",
              "--database-url", "postgresql://h/x"])  # fmt: skip
    assert "cannot read the token ids of @/nonexistent/ids" in str(exit_.value.code)


def test_sources_show_times_not_milliseconds() -> None:
    from kvledger.sources_cmd import _started

    assert _started(1_764_000_000_000) == "2025-11-24 16:00:00"
    assert _started(5) == "5"  # an epoch numbered otherwise stays as it is


def test_a_tie_is_called_a_tie() -> None:
    from kvledger.lookup_cmds import _routing
    from kvledger.schemas.lookup import Ranked

    tied = [Ranked(f"engine-{i}", 512.0, {"GPU": 512}) for i in range(4)]
    assert _routing(tied) == "a 4-way tie at score 512: engine-0, engine-1, engine-2, engine-3"
    assert _routing([Ranked("a", 9.0, {}), Ranked("b", 3.0, {})]) == "route to a (score 9)"


def test_the_version_says_which_parts_are_compiled() -> None:
    import os
    import subprocess
    import sys

    def version(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "kvledger", "--version"], text=True, capture_output=True,
            check=True, env={**os.environ, **env},
        )  # fmt: skip
        return done.stdout

    assert version().startswith("kvledger ")
    assert "router index compiled" in version()  # the router index is the core's alone
    assert "Avro codec compiled" in version()
    assert "Avro codec pure Python" in version(KVLEDGER_PURE_AVRO="1")


def test_the_metrics_say_which_parts_are_compiled() -> None:
    from prometheus_client import generate_latest

    from kvledger.consumer.metrics import REGISTRY
    from kvledger.schemas.codec import compiled_parts

    text = generate_latest(REGISTRY).decode()
    for part, compiled in compiled_parts().items():
        assert f'kvledger_compiled_core{{part="{part}"}} {float(compiled)}' in text


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["consume", "--batch-size", "0"], "--batch-size: 0 is out of range: at least 1"),
        (["consume", "--batch-size", "-5"], "--batch-size: -5 is out of range: at least 1"),
        (["consume", "--batch-timeout", "nan"], "--batch-timeout: 'nan' is not a finite number"),
        (["serve", "--port", "70000"], "--port: 70000 is out of range: at least 1 and at most"),
        (["relay", "--endpoint", "tcp://h:1", "--source", "s", "--model", "m",
          "--dp-size", "0"], "--dp-size: 0 is out of range"),
        (["sources", "--silent-after", "soon"], "--silent-after: 'soon' is not a duration"),
        (["sources", "--silent-after", "-3"], "--silent-after: '-3' is not a duration"),
    ],
)  # fmt: skip
def test_a_number_out_of_range_is_refused_before_the_command_runs(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_a_window_takes_a_unit_or_plain_seconds() -> None:
    parser = build_parser()
    assert parser.parse_args(["sources", "--silent-after", "5m"]).silent_after == 300.0
    assert parser.parse_args(["sources", "--silent-after", "45"]).silent_after == 45.0


def test_a_mistyped_dead_letter_reason_is_refused_with_the_codes() -> None:
    url = "postgresql+psycopg://kv:pw@127.0.0.1:1/db"  # never reached
    for command in ("replay", "list"):
        with pytest.raises(SystemExit) as stop:
            main(["dlq", command, "--reason", "dupliate", "--database-url", url])
        said = str(stop.value.code)
        assert "no reason code 'dupliate'" in said and "did you mean 'duplicate'" in said


def test_http_clients_do_not_log_each_request_unless_verbose() -> None:
    import logging

    url = "postgresql+psycopg://kv:pw@127.0.0.1:1/db"
    assert main(["sources", "--database-url", url]) == 1
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING


def test_the_relay_says_which_engines_it_reads() -> None:
    relay = next(
        sub
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
        if name == "relay"
    )
    described = " ".join((relay.description or "").split())
    assert all(engine in described for engine in ("vLLM", "SGLang", "TensorRT-LLM"))


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [("0.0.0.0", None, True), ("::", None, True), ("serve.example", None, True),
     ("0.0.0.0", "t0ken", False), ("127.0.0.1", None, False), ("::1", None, False),
     ("localhost", None, False), ("127.0.0.2", None, False)],
)  # fmt: skip
def test_serving_a_public_address_without_a_token_warns(
    host: str, token: str | None, warned: bool
) -> None:
    from kvledger.lookup_cmds import exposure_warning

    said = exposure_warning(host, token)
    assert (said is not None) == warned
    if said:
        assert host in said and "without a token" in said


def test_debug_and_log_format_work_after_the_command_too() -> None:
    """`kvledger sources --debug` was refused ("unrecognized argument"): the options taken
    before any command are taken after it as well, and only when given."""
    from kvledger.cli import build_parser

    parser = build_parser(environ={})
    assert parser.parse_args(["sources", "--debug"]).verbose is True
    assert parser.parse_args(["groups", "list", "-v"]).verbose is True
    assert parser.parse_args(["--debug", "sources"]).verbose is True
    assert parser.parse_args(["sources"]).verbose is False
    assert parser.parse_args(["sources", "--log-format", "json"]).log_format == "json"
    assert parser.parse_args(["--log-format", "json", "sources"]).log_format == "json"


def test_serve_on_a_busy_port_says_so_in_one_line() -> None:
    """uvicorn logged "ERROR uvicorn.error: [Errno 98] …" and exited 3, after the index was
    loaded: the port is now tried first, and a busy one named in one line."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # never reached
        with pytest.raises(SystemExit) as refused:
            main(["serve", "--database-url", url, "--allow-writer", "--port", str(port)])
    said = str(refused.value.code)
    assert f"port {port} on 127.0.0.1 is in use" in said and "--port" in said, said


def test_a_refused_connection_says_what_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    """ "Connection refused" (the services down) named no next step, where "no database"
    suggested `scripts/services up`."""
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # nothing listens on port 1
    assert main(["sources", "--database-url", url]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "Connection refused" in said[0], said
    assert "`scripts/services up` starts a local one" in said[0], said


def test_the_servers_ordinary_lines_are_not_named_errors() -> None:
    """`serve` logged "Started server process" and the like under ``uvicorn.error``."""
    import logging

    from kvledger.lookup_cmds import _ServerLines

    lines = _ServerLines()
    started = logging.LogRecord("uvicorn.error", logging.INFO, "", 0, "Started", None, None)
    failed = logging.LogRecord("uvicorn.error", logging.ERROR, "", 0, "[Errno 98]", None, None)
    assert lines.filter(started) and started.name == "kvledger.serve"
    assert lines.filter(failed) and failed.name == "uvicorn.error"
