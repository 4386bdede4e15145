"""The holder-mask tables (consumer.router.masks): the compiled MaskTable and the pure
MaskDict, driven by the same operations, hold the same masks and walk prompts alike."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.consumer.router import masks
from kvledger.consumer.router.masks import MaskDict, runs

compiled = pytest.mark.skipif(
    masks.MaskTable is None and os.environ.get("CI") != "true",
    reason="the compiled core was not built (no Rust toolchain); CI requires it",
)

# Few distinct keys, of several lengths (8-byte int64 forms, 32-byte digests, odd sizes), so
# that operations meet the same keys again; holder ids across word boundaries (0..199).
KEYS = [bytes([i]) * n for i in range(12) for n in (8, 32, 3)] + [b""]
ops = st.lists(
    st.tuples(st.sampled_from(["set", "clear", "end"]), st.sampled_from(KEYS), st.integers(0, 199)),
    max_size=300,
)


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


@compiled
@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.sampled_from([*KEYS, b"nobody"]), max_size=40), st.integers(1, 4))
def test_the_compiled_table_answers_as_the_pure_one(
    operations: list[tuple[str, bytes, int]], prompt: list[bytes], ratio: int
) -> None:
    assert masks.MaskTable is not None
    fast, pure = masks.MaskTable(), MaskDict()
    for op, key, bit in operations:
        if op == "set":
            assert fast.set_bit(key, bit) is pure.set_bit(key, bit)
        elif op == "end":  # a token end: kept only for a held key
            assert fast.set_end(key, bit * 16) is pure.set_end(key, bit * 16)
        else:
            assert fast.clear_bit(key, bit) is pure.clear_bit(key, bit)
    assert dict(fast.items()) == dict(pure) and len(fast) == len(pure)
    assert sorted(fast.keys()) == sorted(pure) == sorted(fast)
    for key in KEYS:
        assert (key in fast) is (key in pure)
        assert fast.get(key, 0) == pure.get(key, 0) == fast.mask(key) == pure.mask(key)
        assert all(fast.has_bit(key, b) is pure.has_bit(key, b) for b in (0, 63, 64, 199, 500))
    for bit in (0, 1, 63, 64, 130, 199, 500):
        assert sorted(fast.held_by(bit)) == sorted(pure.held_by(bit))
    assert sorted(fast.runs(prompt)) == sorted(pure.runs(prompt))
    assert sorted(fast.runs_covered(prompt, ratio)) == sorted(pure.runs_covered(prompt, ratio))


@compiled
def test_the_compiled_table_grows_and_shrinks() -> None:
    """A table filled past many resizes and emptied again (deletions shift entries back
    into the holes): every key is found at every step, as the dict finds it."""
    assert masks.MaskTable is not None
    rng = random.Random(5)
    fast, pure = masks.MaskTable(), MaskDict()
    keys = [rng.randbytes(8) for _ in range(20_000)]
    for i, k in enumerate(keys):
        fast.set_bit(k, i % 130)
        pure.set_bit(k, i % 130)
    rng.shuffle(keys)
    for k in keys[:15_000]:
        bit = pure.get(k, 0).bit_length() - 1
        assert fast.clear_bit(k, bit) is pure.clear_bit(k, bit) is False
    assert dict(fast.items()) == dict(pure) and len(fast) == 5_000
    prompt = keys[14_990:15_010]
    for k in keys[15_000:15_003]:
        assert fast.set_end(k, 7) is pure.set_end(k, 7) is True
    assert fast.runs(prompt) == pure.runs(prompt) == []  # the first is gone
    assert fast.runs(keys[15_000:15_003]) == pure.runs(keys[15_000:15_003])


@compiled
def test_the_compiled_table_refuses_what_is_not_a_hash() -> None:
    assert masks.MaskTable is not None
    t = masks.MaskTable()
    with pytest.raises(TypeError, match="bytes"):
        t.set_bit("text", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        t.runs([b"ok", 7])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        t.set_bit(b"k", -1)
    assert t.get(7, 0) == 0 and 7 not in t  # type: ignore[arg-type]


def test_ci_builds_the_compiled_table() -> None:
    if os.environ.get("CI") == "true":
        assert masks.COMPILED, "CI must build the compiled core (rust/: is cargo there?)"
    else:
        assert (
            masks.MaskTable is not None and os.environ.get("KVLEDGER_PURE_MASKS", "") in ("", "0")
        ) == masks.COMPILED


@compiled
def test_the_tables_hash_is_keyed_per_table_and_process() -> None:
    """Where a key lands depends on a secret seed of each table, not on the key alone:
    the same key hashes differently in two tables of one process and in two processes, and
    keys crafted to share their bucket bits under the unkeyed mix the table used before
    spread over the buckets as random keys do."""
    import subprocess
    import sys

    from bench.flood import crafted_keys

    assert masks.MaskTable is not None
    a, b = masks.MaskTable(), masks.MaskTable()
    keys = [i.to_bytes(8, "big") for i in range(64)]
    assert sum(a._hash(k) == b._hash(k) for k in keys) == 0
    probe = "from kvledger._core import MaskTable; print(MaskTable()._hash(bytes(8)))"
    run = [sys.executable, "-c", probe]
    runs = {subprocess.run(run, capture_output=True, text=True, check=True).stdout for _ in "ab"}
    assert len(runs) == 2
    crafted = crafted_keys(4096, random.Random(3))
    buckets = {a._hash(k) & 0xFFFFFF for k in crafted}
    assert len(buckets) > 4000  # 4,096 keys in 2**24 buckets: a collision or two at most
