"""The pure holder-mask table (tests/helpers/pure_router/masks.py's MaskDict) and the run walk; the
compiled core's groups are held to the pure ones in tests/unit/test_group.py."""

from __future__ import annotations

import pytest

from tests.helpers.pure_router.masks import MaskDict, runs


def test_runs() -> None:
    assert runs([0b111, 0b101, 0b100, 0b110]) == [(1, 1), (0, 2), (2, 4)]
    assert runs([0, 0b1]) == [] and runs([]) == []


def test_the_pure_table() -> None:
    t = MaskDict()
    assert t.set_bit(b"a", 3) is True and t.set_bit(b"a", 70) is False  # new, then known
    assert t.set_end(b"a", 48) is True and t.set_end(b"b", 16) is False
    assert t.get(b"a", 0) == (1 << 3 | 1 << 70) and t.has_bit(b"a", 70)
    assert t.clear_bit(b"a", 3) is True and t.clear_bit(b"a", 70) is False
    assert b"a" not in t and len(t) == 0
    t.set_bit(b"x", 0)
    t.set_bit(b"y", 0)
    t.set_bit(b"z", 1)  # z ends its block: covers position 2 for holder 1 at ratio 2
    t.set_end(b"y", 32)
    assert t.runs([b"x", b"y", b"z"]) == [(0, 2, 32)]
    assert sorted(t.runs_covered([b"x", b"z"], 2)) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError):
        t.runs_covered([b"x"], 0)
