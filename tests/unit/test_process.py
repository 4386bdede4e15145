"""kvledger/process.py: the long-running commands' collector settings."""

from __future__ import annotations

import gc

from kvledger.process import SERVER_COLLECTION, collect_less_often


def test_a_server_collects_in_larger_rarer_passes() -> None:
    before = gc.get_threshold()
    try:
        collect_less_often()
        assert gc.get_threshold() == SERVER_COLLECTION
        # Rarer than Python's default young passes (700; compared with the constant: a
        # command run in this process, as some tests do, may have set the thresholds).
        assert SERVER_COLLECTION[0] > 700
    finally:
        gc.set_threshold(*before)
