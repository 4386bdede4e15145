"""The pure router's holder masks: block hash -> a bitmask of holder ids, probed a prompt at a
time, and beside each held hash its block's token end (so that a block-granularity walk
reports matched tokens without a second probe per holder). ``MaskDict`` is what
:class:`~tests.helpers.pure_router.group.PureGroup` keeps; the compiled core's groups hold
the same masks natively (rust/src/group.rs, rust/src/masks.rs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import reduce
from itertools import repeat
from operator import or_


class MaskDict(dict[bytes, int]):
    """The pure-Python mask table (a dict of Python ints, and one of token ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[bytes, int] = {}

    def set_bit(self, key: bytes, bit: int) -> bool:
        """The holder with id ``bit`` holds ``key``; whether ``key`` is new here."""
        old = self.get(key)
        self[key] = (old or 0) | 1 << bit
        return old is None

    def set_end(self, key: bytes, end: int) -> bool:
        """``key``'s token end, if ``key`` is held (whether it is)."""
        if key not in self:
            return False
        self.ends[key] = end
        return True

    def clear_bit(self, key: bytes, bit: int) -> bool:
        """Whether anyone still holds ``key``."""
        mask = self.get(key, 0) & ~(1 << bit)
        if mask:
            self[key] = mask
            return True
        self.pop(key, None)
        self.ends.pop(key, None)
        return False

    def has_bit(self, key: bytes, bit: int) -> bool:
        return bool(self.get(key, 0) >> bit & 1)

    def held_by(self, bit: int) -> list[bytes]:
        """The keys holder ``bit`` holds (an engine restart or a clear ends them all)."""
        return [h for h, mask in self.items() if mask >> bit & 1]

    def mask(self, key: bytes) -> int:
        """``key``'s holders as bits (0: nobody's)."""
        return self.get(key, 0)

    def runs(self, hashes: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """(holder id, run length, token end of the run's last hash) for each holder of the
        first hash."""
        ends = self.ends
        return [
            (hid, n, ends.get(hashes[n - 1], 0))
            for hid, n in runs(map(self.get, hashes, repeat(0)))
        ]

    def level_runs(self, levels: Sequence[Sequence[bytes]]) -> list[tuple[int, int, int]]:
        """As :meth:`runs` over levels of hashes (a token walk's: each level's blocks hold
        the same tokens): a holder holds a level when it holds any of its hashes; the token
        end is the furthest of the hashes it holds at its last level."""
        get, ends = self.get, self.ends
        out = []
        for hid, n in runs(reduce(or_, (get(h, 0) for h in level), 0) for level in levels):
            bit = 1 << hid
            held = [ends.get(h, 0) for h in levels[n - 1] if get(h, 0) & bit]
            out.append((hid, n, max(held, default=0)))
        return out

    def runs_covered(self, hashes: Sequence[bytes], ratio: int) -> list[tuple[int, int]]:
        """As :meth:`runs`, with position i also covered by the last hash of its block."""
        if ratio <= 0:
            raise ValueError("ratio must be positive")
        own = [self.get(h, 0) for h in hashes]
        size = len(own)
        covered = []
        for i in range(size):
            end = (i // ratio + 1) * ratio
            covered.append(own[i] | (own[end - 1] if end <= size else 0))
        return runs(covered)


def runs(masks: Iterable[int]) -> list[tuple[int, int]]:
    """(holder id, run length) for every holder covering position 1, from per-position
    bitmasks of the holders covering it (read lazily: the walk stops once no holder runs)."""
    it = iter(masks)
    alive = next(it, 0)
    out: list[tuple[int, int]] = []
    n = 1
    while alive:
        mask = next(it, None)
        if mask is None:
            break
        still = alive & mask
        if still != alive:
            out.extend((hid, n) for hid in bits(alive & ~still))
            alive = still
        n += 1
    out.extend((hid, n) for hid in bits(alive))
    return out


def bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
