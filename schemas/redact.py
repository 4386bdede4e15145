"""Secrets out of text: a password in a URL or a libpq keyword string becomes ***.

Lives with the contract's helpers (no dependency beyond the standard library) because every
install needs it: the publisher's errors, the CLI's one-line errors and JSON logs, and the
consumer's and lookup service's messages.
"""

from __future__ import annotations

import re

_SECRET_IN_URL = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
# A URL's user part without its scheme (``user:password@host``), as a mistyped URL has it.
_SECRET_IN_USERINFO = re.compile(r"(?<![\w/:.%@-])([\w.%+-]+:)[^@\s/'\"]+@(?=[\w\[])")
_SECRET_IN_KEYWORDS = re.compile(r"(password\s*=\s*)('[^']*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with any password in it (URL or keyword form) replaced by ***."""
    text = _SECRET_IN_USERINFO.sub(r"\1***@", _SECRET_IN_URL.sub(r"\1***@", text))
    return _SECRET_IN_KEYWORDS.sub(r"\1***", text)
