"""`kvledger completion bash|zsh` (issue 48's item 22): the script, run in a real bash,
completes every command, action and option from the parser itself."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from kvledger.cli import build_parser
from kvledger.completion import script, table


def complete(tmp_path: object, *words: str) -> list[str]:
    """What the script offers after ``kvledger WORDS`` (the last word being typed)."""
    path = f"{tmp_path}/kvledger.bash"
    with open(path, "w") as f:
        f.write(script(build_parser(), "bash"))
    quoted = " ".join(f"'{w}'" for w in ("kvledger", *words))
    run = subprocess.run(
        ["bash", "-c", f'source {path}; COMP_WORDS=({quoted}); '
         'COMP_CWORD=$((${#COMP_WORDS[@]}-1)); _kvledger_complete; echo "${COMPREPLY[*]}"'],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return run.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_completes_commands_actions_and_options(tmp_path: object) -> None:
    assert {"consume", "serve", "status", "dlq", "completion"} <= set(complete(tmp_path, ""))
    assert complete(tmp_path, "st") == ["status"]
    assert complete(tmp_path, "dlq", "") == ["list", "replay", "--help"]
    assert complete(tmp_path, "dlq", "list", "--re") == ["--reason"]
    assert complete(tmp_path, "serve", "--max") == ["--max-connections"]


def test_every_command_and_option_is_in_the_table() -> None:
    words = table(build_parser())
    assert "--dlq-topic" in words["consume"] and "--memory" in words["serve"]
    assert set(words[""]) >= {"relay", "verify", "--version"}
    assert script(build_parser(), "zsh").startswith("autoload -U +X bashcompinit")
