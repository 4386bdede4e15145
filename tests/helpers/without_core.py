"""Importing a module as an install without the compiled core (kvledger._core) would."""

from __future__ import annotations

import subprocess
import sys


def import_error(module: str) -> str:
    """``ImportError's type and message`` when ``module`` is imported in a fresh interpreter
    that cannot import kvledger._core ("" when the import succeeds)."""
    code = (
        "import sys; sys.modules['kvledger._core'] = None\n"
        f"try:\n    import {module}\n"
        "except ImportError as e:\n    print(type(e).__name__, e)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip
    return done.stdout
