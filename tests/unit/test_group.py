"""The router's groups (consumer.router.store): the compiled core's Group and the pure
PureGroup, driven by the same operations, hold the same blocks and residencies and answer
every lookup alike (by hashes, at hash granularity, by tokens)."""

from __future__ import annotations

import random
import subprocess
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.flood import crafted_keys
from kvledger.serving.router import groups as store
from tests.helpers.pure_router.group import PureGroup
from tests.helpers.without_core import import_error

Compiled = store.Group  # the router's groups are the compiled core's (its import says so)

# Few distinct keys of several lengths (8-byte int64 forms, 32-byte digests, odd sizes), so
# that operations meet the same keys again; holder ids across word boundaries (0..199, and
# 260 and 329: groups wider than the 1-4 words lookups are specialised for); few distinct
# token blocks, so that token walks find chains.
KEYS = [bytes([i]) * n for i in range(8) for n in (8, 32, 3)] + [b""]
# Ids that the core packs at 2, 3 and 4 bytes each (over 65,535; over 2**24; negative).
BLOCKS = [(1, 2), (3, 4), (5, 6), (1, 2, 3, 4), (7,), (70_000, 2), (1 << 24, -5), (-1, 1)]
# Positions: none, small, and those a row keeps beside it (past 32 bits, negative).
STARTS = [None, 0, 2, 4, 2**32 - 2, 2**32 + 6, 2**40, -3, -(2**63)]
LORAS = [None, None, "adapter"]
SALTS = [None, None, "salt-1"]  # a first block's cache salt (kept under the root only)
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.sampled_from(KEYS),
            st.sampled_from([None, *KEYS]),
            st.sampled_from(STARTS),
            st.sampled_from(BLOCKS),
            st.sampled_from([0, 1, 2, 4]),
            st.booleans(),
            st.sampled_from(LORAS),
            st.booleans(),
            st.sampled_from(SALTS),
        ),
        st.tuples(
            st.just("hold"),
            st.sampled_from(KEYS),
            st.one_of(st.integers(0, 199), st.sampled_from([260, 329])),  # 5 or 6 words wide
            st.sampled_from([0, 0, 1, 1, 3]),
        ),
        st.tuples(
            st.just("meta"),
            st.sampled_from(KEYS),
            st.sampled_from(LORAS),
            st.booleans(),
            st.sampled_from(SALTS),
        ),
        # The clock stores and holders stamp (it may go back: both stamp what it says),
        # and expiry of what is older than a cutoff.
        st.tuples(st.just("clock"), st.integers(0, 6)),
        st.tuples(st.just("expire"), st.integers(0, 7)),
    ),
    max_size=200,
)
PROMPTS = st.lists(st.sampled_from([*KEYS, b"nobody"]), max_size=30)
TOKENS = st.lists(
    st.sampled_from([1, 2, 3, 4, 5, 6, 7, 9, 70_000, 1 << 24, -5, -1, 70_000 + (1 << 16)]),
    max_size=14,
)


def apply(group: object, operations: list[tuple]) -> list[int]:  # type: ignore[type-arg]
    """The operations on ``group``; what each expiry dropped."""
    dropped = []
    for op, key, *rest in operations:
        if op == "store":
            group.add_row(key, *rest)  # type: ignore[attr-defined]
        elif op == "hold":
            group.hold(key, *rest)  # type: ignore[attr-defined]
        elif op == "clock":
            group.set_clock(key)  # type: ignore[attr-defined]
        elif op == "expire":
            dropped.append(group.expire(key))  # type: ignore[attr-defined]
        else:
            group.set_meta(key, *rest)  # type: ignore[attr-defined]
    return dropped


@settings(max_examples=300, deadline=None)
@given(ops, PROMPTS, TOKENS, st.integers(1, 4), st.sampled_from([(2, 2), (4, 2), (2, 1), (4, 4)]),
       st.sampled_from(LORAS), st.sampled_from(SALTS))  # fmt: skip
def test_the_compiled_group_answers_as_the_pure_one(
    operations: list[tuple], prompt: list[bytes], tokens: list[int], ratio: int,  # type: ignore[type-arg]
    sizes: tuple[int, int], lora: str | None, salt: str | None,
) -> None:  # fmt: skip
    assert Compiled is not None
    fast, pure = Compiled(), PureGroup()
    assert apply(fast, operations) == apply(pure, operations)
    assert len(fast) == len(pure)
    assert sorted(fast.hashes()) == sorted(pure.hashes())
    assert sorted(fast.residencies()) == sorted(pure.residencies())
    for key in [*KEYS, b"nobody"]:
        assert fast.row(key) == pure.row(key)
        assert fast.meta(key) == pure.meta(key)
        assert fast.end_of(key) == pure.end_of(key)
        assert all(fast.refcount(key, h) == pure.refcount(key, h) for h in (0, 63, 64, 199, 500))
    for hid in (0, 1, 63, 64, 130, 199, 260, 329, 500):
        assert sorted(fast.held_by(hid)) == sorted(pure.held_by(hid))
    assert sorted(fast.runs(prompt)) == sorted(pure.runs(prompt))
    assert sorted(fast.runs_covered(prompt, ratio)) == sorted(pure.runs_covered(prompt, ratio))
    bs, hbs = sizes
    assert sorted(fast.match_tokens(tokens, bs, hbs, lora, salt)) == sorted(
        pure.match_tokens(tokens, bs, hbs, lora, salt)
    )
    # Each holder's own hashes down the prompt, as far as the walk says it holds.
    runs = {hid: blocks for hid, blocks, _ in fast.match_tokens(tokens, bs, bs, lora, salt)}
    for hid in (0, 1, 63, 64, 130, 199, 260, 329, 500):
        path = fast.held_path(tokens, bs, lora, hid, salt)
        assert path == pure.held_path(tokens, bs, lora, hid, salt)
        assert len(path) == runs.get(hid, 0)
        assert all(fast.refcount(h, hid) > 0 for h in path)


def test_a_long_chain_is_walked_by_tokens_as_the_pure_group_walks_it() -> None:
    """A thousand-block prompt (chains that branch, holders at several depths, a partial
    tail): the same runs from both groups, and from a walk by the chain's hashes."""
    assert Compiled is not None
    rng = random.Random(7)
    fast, pure = Compiled(), PureGroup()
    tokens = [rng.randrange(50_000) for _ in range(16 * 1000 + 8)]
    parent = None
    chain = []
    for i in range(1000):
        h, sibling = rng.randbytes(8), rng.randbytes(8)
        block = tokens[i * 16 : (i + 1) * 16]
        for g in (fast, pure):
            g.add_row(h, parent, i * 16, block, 16, False, None, True)
            g.hold(h, 99, 1 + i % 3)  # the whole chain
            if i < 600:
                g.hold(h, 98, 1)
            g.hold(h, i % 70, 1)
            if i % 100 == 0:  # a sibling with other tokens under the same parent
                g.add_row(sibling, parent, i * 16, [0] * 16, 16, False, None, True)
                g.hold(sibling, 99, 1)
        parent = h
        chain.append(h)
    tail = rng.randbytes(8)
    for g in (fast, pure):
        g.add_row(tail, parent, 16_000, tokens[16_000:16_008], 8, True, None, True)
        g.hold(tail, 99, 1)
    want = pure.match_tokens(tokens, 16, 8, None)
    assert sorted(fast.match_tokens(tokens, 16, 8, None)) == sorted(want)
    assert {(99, 1000, 16_008), (98, 600, 9600)} <= set(want)  # the chain and its tail
    assert sorted(fast.runs(chain)) == sorted(pure.runs(chain))


@pytest.mark.parametrize("twin_first", [True, False])
def test_a_walk_down_consecutive_rows_finds_every_row_of_a_shared_content(
    twin_first: bool,
) -> None:
    """Blocks stored together sit in consecutive rows, and a token walk takes the next row
    without a probe when it is its level's only one. Two hashes of one content under one
    parent (two engines that hash differently) are both found, whichever came first, and
    a holder holds a level when it holds either: the compiled walk answers as the pure
    one's, which looks at every child."""
    assert Compiled is not None
    fast, pure = Compiled(), PureGroup()
    a, b, twin, c = (bytes([i]) * 8 for i in (1, 2, 3, 4))
    for g in (fast, pure):
        g.add_row(a, None, 0, [1, 2], 2, False, None, True)
        if twin_first:
            g.add_row(twin, a, 2, [3, 4], 2, False, None, True)
        g.add_row(b, a, 2, [3, 4], 2, False, None, True)  # right after a when not twin_first
        g.add_row(c, b, 4, [5, 6], 2, False, None, True)
        if not twin_first:
            g.add_row(twin, a, 2, [3, 4], 2, False, None, True)
        for key, holder in ((a, 1), (a, 2), (b, 1), (twin, 2), (c, 1)):
            g.hold(key, holder, 1)
    for prompt, want in (
        ([1, 2, 3, 4, 5, 6], [(1, 3, 6), (2, 2, 4)]),
        ([1, 2, 3, 4], [(1, 2, 4), (2, 2, 4)]),
    ):
        assert sorted(pure.match_tokens(prompt, 2, 2, None)) == want
        assert sorted(fast.match_tokens(prompt, 2, 2, None)) == want


@pytest.mark.parametrize("moved_next_to_parent", [True, False])
def test_a_block_stored_again_under_a_twin_parent_is_still_walked(
    moved_next_to_parent: bool,
) -> None:
    """The content index leaves out the row right after its parent's (a walk looks there
    first). A block stored again under another parent of the same content keeps its key,
    and may become, or stop being, the row after its parent's: the walk still finds it."""
    assert Compiled is not None
    fast, pure = Compiled(), PureGroup()
    a, twin, b = (bytes([i]) * 8 for i in (1, 2, 3))
    for g in (fast, pure):
        g.add_row(a, None, 0, [1, 2], 2, False, None, True)
        if moved_next_to_parent:  # rows a, twin, b: b moves to right after its parent
            g.add_row(twin, None, 0, [1, 2], 2, False, None, True)
            g.add_row(b, a, 2, [3, 4], 2, False, None, True)
        else:  # rows a, b, twin: b moves away from right after its parent
            g.add_row(b, a, 2, [3, 4], 2, False, None, True)
            g.add_row(twin, None, 0, [1, 2], 2, False, None, True)
        g.add_row(b, twin, 2, [3, 4], 2, False, None, True)
        for key, holder in ((a, 1), (twin, 2), (b, 2)):
            g.hold(key, holder, 1)
    want = [(1, 1, 2), (2, 2, 4)]
    assert sorted(pure.match_tokens([1, 2, 3, 4], 2, 2, None)) == want
    assert sorted(fast.match_tokens([1, 2, 3, 4], 2, 2, None)) == want


def test_rows_without_content_come_and_go_as_they_are_held() -> None:
    """A hash held before its store (or named only as a parent) is a row without content:
    no block in the views, gone when nothing holds or names it; many such rows, removed in
    any order, leave every other row found."""
    assert Compiled is not None
    rng = random.Random(5)
    fast, pure = Compiled(), PureGroup()
    keys = [rng.randbytes(8) for _ in range(20_000)]
    for i, k in enumerate(keys):
        for g in (fast, pure):
            g.hold(k, i % 130, 1)
    rng.shuffle(keys)
    for i, k in enumerate(keys[:15_000]):
        hid = next(h for h in range(130) if pure.refcount(k, h))
        for g in (fast, pure):
            g.hold(k, hid, 0)
        if i % 5000 == 0:
            assert sorted(fast.residencies()) == sorted(pure.residencies())
    assert sorted(fast.residencies()) == sorted(pure.residencies()) and len(fast) == 0
    assert fast.runs(keys[15_000:15_003]) == pure.runs(keys[15_000:15_003])


def test_the_compiled_group_refuses_what_is_not_a_hash() -> None:
    assert Compiled is not None
    g = Compiled()
    with pytest.raises(TypeError, match="bytes"):
        g.hold("text", 1, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        g.runs([b"ok", 7])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="holder id"):
        g.hold(b"k", -1, 1)
    with pytest.raises(ValueError, match="ratio"):
        g.runs_covered([b"k"], 0)
    assert g.row(b"k") is None and g.match_tokens([1, 2], 0, 0, None) == []


def test_an_install_without_the_core_says_the_router_needs_it() -> None:
    """The router index is the compiled core's alone: without it, importing the router
    fails with one sentence saying what to install, not an ImportError of a private name."""
    said = import_error("kvledger.serving.router.groups")
    assert said.startswith("MissingCoreError the router index needs kvledger's compiled core"), said
    assert "Rust toolchain (cargo)" in said


def test_the_groups_hash_is_keyed_per_group_and_process() -> None:
    """Where a key lands depends on a secret seed of each group, not on the key alone: the
    same key hashes differently in two groups of one process and in two processes, and keys
    crafted to share their bucket bits under the unkeyed mix kvledger's C table used spread
    over the buckets as random keys do."""
    assert Compiled is not None
    a, b = Compiled(), Compiled()
    keys = [i.to_bytes(8, "big") for i in range(64)]
    assert sum(a._hash(k) == b._hash(k) for k in keys) == 0
    probe = "from kvledger._core import Group; print(Group()._hash(bytes(8)))"
    run = [sys.executable, "-c", probe]
    runs = {subprocess.run(run, capture_output=True, text=True, check=True).stdout for _ in "ab"}
    assert len(runs) == 2
    crafted = crafted_keys(4096, random.Random(3))
    buckets = {a._hash(k) & 0xFFFFFF for k in crafted}
    assert len(buckets) > 4000  # 4,096 keys in 2**24 buckets: a collision or two at most


def test_a_cycle_of_parents_is_walked_as_the_pure_group_walks_it() -> None:
    """Parent links that loop (a block re-stored under its own child, or under itself) once
    made the compiled group's content keys chase each other for ever (found by fuzzing):
    no walk from the root reaches such blocks, in either group."""
    assert Compiled is not None
    fast, pure = Compiled(), PureGroup()
    for g in (fast, pure):
        g.add_row(b"a", None, 0, [1, 2], 2, False, None, True)
        g.add_row(b"b", b"a", 2, [3, 4], 2, False, None, True)
        g.hold(b"a", 0, 1)
        g.hold(b"b", 0, 1)
        g.add_row(b"a", b"b", 0, [1, 2], 2, False, None, True)
        g.add_row(b"c", b"c", 0, [1, 2], 2, False, None, True)
    assert (
        fast.match_tokens([1, 2, 3, 4], 2, 2, None)
        == pure.match_tokens([1, 2, 3, 4], 2, 2, None)
        == []
    )
    for g in (fast, pure):
        g.add_row(b"a", None, 0, [1, 2], 2, False, None, True)
    assert fast.match_tokens([1, 2, 3, 4], 2, 2, None) == pure.match_tokens(
        [1, 2, 3, 4], 2, 2, None
    )
    assert fast.match_tokens([1, 2, 3, 4], 2, 2, None) == [(0, 2, 4)]


@pytest.mark.parametrize("make", [PureGroup, Compiled])
def test_a_salted_prompt_is_walked_from_its_salted_first_block(make: type) -> None:
    """A first block whose only extra key is a cache salt starts the walk of that salt; its
    children are reached through it; the same tokens unsalted are another walk."""
    g = make()
    g.add_row(b"s0", None, 0, [1, 2], 2, False, None, True, "salt-1")
    g.add_row(b"s1", b"s0", 2, [3, 4], 2, False, None, True, "salt-1")  # kept on a root only
    g.add_row(b"p0", None, 0, [1, 2], 2, False, None, True)
    for key in (b"s0", b"s1", b"p0"):
        g.hold(key, 0, 1)
    assert g.match_tokens([1, 2, 3, 4], 2, 2, None, "salt-1") == [(0, 2, 4)]
    assert g.match_tokens([1, 2, 3, 4], 2, 2, None) == [(0, 1, 2)]  # p0 only
    assert g.match_tokens([1, 2], 2, 2, None, "salt-2") == []
    assert g.meta(b"s0") == (None, True, "salt-1") and g.meta(b"s1") == (None, True, None)
    g.enable_dynamo()
    assert g.dynamo_local(b"s0") is None and g.dynamo_local(b"p0") is not None


def test_token_ids_of_every_width_are_kept_and_matched_exactly() -> None:
    """The core packs a block's ids at 2, 3 or 4 bytes each (the fewest its largest needs):
    rows come back as stored, and an id that only agrees in the bytes a narrower block
    keeps does not match."""
    assert Compiled is not None
    fast, pure = Compiled(), PureGroup()
    blocks = [[5, 65_535], [65_536, 7], [(1 << 24) - 1, 1], [1 << 24, -1], [-(1 << 31), 2]]
    parent = None
    for i, block in enumerate(blocks):
        h = bytes([i + 1]) * 8
        for g in (fast, pure):
            g.add_row(h, parent, 2 * i, block, 2, False, None, True)
            g.hold(h, 3, 1)
        parent = h
    prompt = [t for block in blocks for t in block]
    for g in (fast, pure):
        assert [g.row(bytes([i + 1]) * 8)[2] for i in range(5)] == [tuple(b) for b in blocks]  # type: ignore[index]
        assert g.match_tokens(prompt, 2, 2, None) == [(3, 5, 10)]
    for at, wrong in ((1, 65_535 + (1 << 16)), (2, 65_536 + (1 << 16)), (4, 1), (7, 0x7FFF_FFFF)):
        other = [*prompt[:at], wrong, *prompt[at + 1 :]]
        assert fast.match_tokens(other, 2, 2, None) == pure.match_tokens(other, 2, 2, None)
        assert fast.match_tokens(other, 2, 2, None) == (
            [(3, at // 2, at // 2 * 2)] if at > 1 else []
        )


def test_token_ids_in_an_int32_buffer_are_taken_as_a_list_of_them_is() -> None:
    """A prompt's ids may come packed (array('i'), a NumPy int32 array, a strided view):
    the compiled group copies them whole, and answers and stores as from a list, as the
    pure group does; a buffer of another type is read item by item, its refusals kept."""
    assert Compiled is not None
    fast, pure = Compiled(), PureGroup()
    rng = random.Random(3)
    prompt = [rng.randrange(-(1 << 31), 1 << 31) for _ in range(8)]
    for g in (fast, pure):
        g.add_row(b"a" * 8, None, 0, array("i", prompt[:4]), 4, False, None, True)
        g.add_row(b"b" * 8, b"a" * 8, 4, prompt[4:], 4, False, None, True)
        g.hold(b"a" * 8, 1, 1)
        g.hold(b"b" * 8, 1, 1)
    strided = memoryview(array("i", [x for t in prompt for x in (t, 0)]))[::2]
    for g in (fast, pure):
        assert g.row(b"a" * 8)[2] == tuple(prompt[:4])  # type: ignore[index]
        for packed in (array("i", prompt), strided, array("q", prompt)):
            assert g.match_tokens(packed, 4, 4, None) == [(1, 2, 8)]
    assert fast.match_tokens(array("i", prompt[:4] + [0] * 4), 4, 4, None) == [(1, 1, 4)]
    with pytest.raises(ValueError, match="int32"):
        fast.match_tokens(array("q", [1 << 40]), 4, 4, None)
