"""kvledger/process.py: a server's collector settings."""

from __future__ import annotations

import gc

from kvledger.process import SERVER_COLLECTION, collect_less_often


def test_a_server_collects_in_larger_rarer_passes() -> None:
    before = gc.get_threshold()
    try:
        collect_less_often()
        assert gc.get_threshold() == SERVER_COLLECTION
        assert SERVER_COLLECTION[0] > before[0]  # rarer than Python's default young passes
    finally:
        gc.set_threshold(*before)
