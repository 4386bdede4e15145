"""`kvledger completion bash|zsh`: a shell completion script, written from the command's own
parser, so it names every command, action and option this version has (regenerate it after
an upgrade: `eval "$(kvledger completion bash)"` in a shell's start-up file does that)."""

from __future__ import annotations

import argparse
import shlex


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """The options a command's help offers (not those it only accepts: --debug after it)."""
    return sorted(
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--")
    )


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def table(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """What follows each command path ("" the top level, "dlq", "dlq list"): its
    subcommands, then its options."""
    out: dict[str, list[str]] = {}

    def walk(path: str, p: argparse.ArgumentParser) -> None:
        subs = _subcommands(p)
        out[path] = [*sorted(subs), *_options(p)]
        for name, sub in subs.items():
            walk(f"{path} {name}".strip(), sub)

    walk("", parser)
    return out


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for ``shell`` (bash; zsh through its bash completion)."""
    cases = "\n".join(
        f"    {shlex.quote(path or '_')}) words={shlex.quote(' '.join(words))} ;;"
        for path, words in sorted(table(parser).items())
    )
    body = f"""_kvledger_complete() {{
  local cur path word words
  cur="${{COMP_WORDS[COMP_CWORD]}}"
  path=""
  for word in "${{COMP_WORDS[@]:1:COMP_CWORD-1}}"; do
    case "$word" in -*) ;; *) case " $(_kvledger_words "${{path:-_}}") " in
      *" $word "*) path="${{path:+$path }}$word" ;; esac ;; esac
  done
  COMPREPLY=($(compgen -W "$(_kvledger_words "${{path:-_}}")" -- "$cur"))
}}
_kvledger_words() {{
  local words=""
  case "$1" in
{cases}
  esac
  echo "$words"
}}
complete -o default -F _kvledger_complete kvledger
"""
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + body
    return body


def run(args: argparse.Namespace) -> int:
    from kvledger.cli import build_parser

    print(script(build_parser(), args.shell), end="")
    return 0
