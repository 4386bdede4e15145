"""A TOML file of settings beside the environment: ``$KVLEDGER_CONFIG``, else
``~/.config/kvledger/config.toml`` when it exists. Each setting is the variable it stands for
(kvledger/envopts.py), so a flag wins over the environment, the environment over the file,
the file over the default::

    kafka-bootstrap = "broker1:9092"       # $KVLEDGER_KAFKA_BOOTSTRAP: every command's broker
    database-url-file = "/run/secrets/db"  # $KVLEDGER_DATABASE_URL_FILE

    [consume]                              # kvledger consume's options
    batch-size = 2000                      # $KVLEDGER_CONSUME_BATCH_SIZE

    [groups.declare]
    model = "llama-3-8b"                   # $KVLEDGER_GROUPS_DECLARE_MODEL

A table is a command (or a command and its action), a key its option or a shared setting's
name without ``KVLEDGER_``; a list is written comma-separated (a repeated option), a boolean
as true or false. The file's values fill the environment of this process only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from kvledger import files
from kvledger.envopts import PREFIX

ENV_CONFIG = "KVLEDGER_CONFIG"
# A table is a command, or a command and its action: a setting sits at most this deep.
MAX_DEPTH = 3
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class ConfigFileError(ValueError):
    """The file cannot be read, or holds what no setting takes."""


def path(environ: MutableMapping[str, str]) -> Path | None:
    """The file to read: $KVLEDGER_CONFIG (which must exist), else the user's, if any."""
    named = environ.get(ENV_CONFIG)
    if named:
        return Path(named)
    home = Path(environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    default = home / "kvledger" / "config.toml"
    return default if default.is_file() else None


def variables(data: dict[str, Any], where: tuple[str, ...] = ()) -> Iterator[tuple[str, str, str]]:
    """(variable, value as the environment would hold it, where in the file) for every
    setting in ``data``."""
    for key, value in data.items():
        place = ".".join((*where, key))
        if not _NAME.fullmatch(key):
            raise ConfigFileError(f"{place[:200]!r}: a key is letters, digits, - and _")
        if isinstance(value, dict):
            if len(where) + 1 >= MAX_DEPTH:
                raise ConfigFileError(
                    f"{place[:200]}: tables nest at most {MAX_DEPTH - 1} deep"
                    " (a command and its action)"
                )
            yield from variables(value, (*where, key))
            continue
        name = "_".join(w.upper().replace("-", "_") for w in (PREFIX, *where, key))
        if isinstance(value, list) and all(_scalar(v) for v in value):
            text = ",".join(_text(v) for v in value)
        elif _scalar(value):
            text = _text(value)
        else:
            kind = type(value).__name__  # not its repr: it may nest without end
            raise ConfigFileError(
                f"{place}: a {kind} is not a setting's value (a string, a "
                "number, a boolean, or a list of them)"
            )
        yield name, text, (f"[{'.'.join(where)}] " if where else "") + key


def _scalar(value: object) -> bool:
    return isinstance(value, str | int | float | bool)


def _text(value: object) -> str:
    """A value as the environment holds it (a boolean as true or false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def load(
    environ: MutableMapping[str, str] | None = None,
) -> tuple[Path | None, list[tuple[str, str]]]:
    """Fill ``environ`` (default: this process's, which its children inherit) with the
    file's settings it does not already hold; returns the file read (None: none) and the
    (variable, place in the file) of each setting it holds. Raises :class:`ConfigFileError`."""
    env = os.environ if environ is None else environ
    found = path(env)
    if found is None:
        return None, []
    import tomllib  # only when there is a file: every command's start-up counts

    try:
        data = tomllib.loads(files.read_text(str(found)))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{found} is not TOML: {exc}") from None
    except RecursionError:
        raise ConfigFileError(f"{found} is not TOML kvledger reads: it nests too deep") from None
    except files.FileTooLargeError as exc:
        raise ConfigFileError(str(exc)) from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError
        raise ConfigFileError(f"cannot read {found}: {exc}") from None
    named = []
    for name, value, place in variables(data):
        env.setdefault(name, value)
        named.append((name, place))
    return found, named


def check(found: Path, named: list[tuple[str, str]], known: set[str]) -> None:
    """Refuse a setting no option reads (a typo would otherwise be ignored in silence)."""
    import difflib

    for name, place in named:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean ${near[0]}?)" if near else ""
            raise ConfigFileError(f"{found}: {place} (${name}) is read by no command{hint}")
