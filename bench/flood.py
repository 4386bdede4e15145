"""Hash flooding: block hashes crafted to collide in the router's index beside random ones,
through the group in use (residencies held, then 128-hash walks), in one run.

The crafted keys invert the unkeyed mix kvledger's C mask table hashed with once (its
bucket bits made equal): against a group keyed by a secret seed they are ordinary keys, and
the ratios crafted / random stay near 1 (under the old mix: about 60 for inserts and 240
for walks of 20,000 keys, which grows with their number).
"""

from __future__ import annotations

import random
import time

from bench.common import record
from kvledger.serving.router.groups import Group

KEYS = 20_000
_M = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * _C1) & _M
    x ^= x >> 27
    x = (x * _C2) & _M
    return x ^ (x >> 31)


def _unshift(y: int, s: int) -> int:
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x


def _unmix(y: int) -> int:
    y = (_unshift(y, 31) * pow(_C2, -1, 1 << 64)) & _M
    y = (_unshift(y, 27) * pow(_C1, -1, 1 << 64)) & _M
    return _unshift(y, 30)


def crafted_keys(n: int, rng: random.Random) -> list[bytes]:
    """8-byte keys whose hash under the old unkeyed mix ends in the same 24 bits."""
    start = _mix(8 + 0x9E3779B97F4A7C15)  # the mix of an 8-byte key's length
    return [
        (_unmix((rng.getrandbits(40) << 24) | 0xABCDE) ^ start).to_bytes(8, "little")
        for _ in range(n)
    ]


def _timed(keys: list[bytes]) -> tuple[float, float]:
    table = Group()
    start = time.perf_counter()
    for k in keys:
        table.hold(k, 1, 1)
    inserted = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, len(keys), 128):
        table.runs(keys[i : i + 128])
    return inserted, time.perf_counter() - start


def main() -> None:
    rng = random.Random(3)
    assert _unmix(_mix(12345)) == 12345
    crafted = crafted_keys(KEYS, rng)
    plain = [rng.getrandbits(64).to_bytes(8, "little") for _ in range(KEYS)]
    best = {"random": (float("inf"),) * 2, "crafted": (float("inf"),) * 2}
    for _ in range(3):  # alternating rounds, the best of each
        for name, keys in (("random", plain), ("crafted", crafted)):
            got = _timed(keys)
            best[name] = (min(best[name][0], got[0]), min(best[name][1], got[1]))
    record("masks_flood", {
        "keys": KEYS,
        "insert_random_ms": best["random"][0] * 1e3,
        "insert_crafted_ms": best["crafted"][0] * 1e3,
        "insert_crafted_vs_random": best["crafted"][0] / best["random"][0],
        "walks_random_ms": best["random"][1] * 1e3,
        "walks_crafted_ms": best["crafted"][1] * 1e3,
        "walks_crafted_vs_random": best["crafted"][1] / best["random"][1],
    })  # fmt: skip


if __name__ == "__main__":
    main()
