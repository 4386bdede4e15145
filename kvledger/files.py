"""Files the command reads (its config, secrets, Kafka settings, a prompt's token ids),
read with a bound: a path that names something endless (``/dev/zero``, a pipe) or huge is
refused in one line, never read into memory whole."""

from __future__ import annotations

SMALL = 1 << 20  # config files, secrets, properties: 1 MiB


class FileTooLargeError(ValueError):
    """The file holds more than its bound."""


def read_text(path: str, limit: int = SMALL) -> str:
    """The file's text (UTF-8), at most ``limit`` bytes: :class:`FileTooLargeError` past it,
    ``OSError`` or ``UnicodeDecodeError`` as reading it says."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileTooLargeError(f"{path} holds more than {_size(limit)}")
    return data.decode("utf-8")


def first_line(path: str, limit: int = SMALL, strip: bool = True) -> str:
    """The file's first line (a secret's convention): stripped of blanks, or with ``strip``
    false of its line end only; read to at most ``limit`` bytes (:class:`FileTooLargeError` when
    no line ends within them)."""
    with open(path, "rb") as f:
        data = f.readline(limit + 1)
    if len(data) > limit:
        raise FileTooLargeError(f"{path}'s first line is longer than {_size(limit)}")
    text = data.decode("utf-8")
    return text.strip() if strip else text.rstrip("\r\n")


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
