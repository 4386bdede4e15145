"""The compiled core's block rows (``kvledger._core.BlockRows``) against the planner's rules
in plain Python (tests/helpers/reference_rows.py), on random events over a few hashes, so
that rows meet again, upgrade, conflict and chain: every answer, every row and its order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger._core import BlockRows, upgrades
from kvledger.consumer.core.model import BlockRow
from tests.helpers.reference_rows import ReferenceRows
from tests.helpers.reference_rows import upgrades as reference_upgrades
from tests.helpers.without_core import import_error

HASHES = (b"a", b"b", b"c", b"d")
# Group 2**32 shares group 0's low 32 bits: the core keys a group by all 64.
MODELS = (("m", 0), ("m", 1), ("m", 2**32))

rows = st.builds(
    BlockRow,
    st.one_of(st.none(), st.sampled_from(HASHES)),
    st.one_of(st.none(), st.integers(0, 6)),
    st.lists(st.integers(0, 3), max_size=4).map(tuple),
    st.sampled_from([0, 2, 4]),
    st.booleans(),
)
events = st.tuples(
    st.sampled_from(MODELS),
    st.lists(st.sampled_from(HASHES), min_size=1, max_size=3).map(tuple),
    st.lists(st.integers(0, 3), max_size=8).map(tuple),
    st.sampled_from([0, 2, 4]),
    st.one_of(st.none(), st.integers(0, 6)),
    st.one_of(st.none(), st.sampled_from(HASHES)),
    st.booleans(),
    st.one_of(st.none(), st.sampled_from(["x", "y"])),
    st.one_of(st.none(), st.lists(st.one_of(st.none(), st.just("k")), max_size=3).map(tuple)),
    st.integers(0, 10),
)
snapshots = st.dictionaries(
    st.tuples(st.sampled_from(MODELS), st.sampled_from(HASHES)).map(lambda k: (*k[0], k[1])),
    rows,
    max_size=5,
)


def _apply(native: BlockRows, reference: ReferenceRows, batch: list) -> None:  # type: ignore[type-arg]
    for (model, group), *rest in batch:
        for h in HASHES:
            assert native.token_end(model, group, h) == reference.token_end(model, group, h)
        assert native.store(model, group, *rest) == reference.store(model, group, *rest)
    assert native.items() == reference.items()


@settings(max_examples=300, deadline=None)
@given(snapshots, st.lists(events, max_size=8), st.lists(events, max_size=8))
def test_block_rows_make_what_the_rules_make(snapshot: dict, base: list, batch: list) -> None:  # type: ignore[type-arg]
    """A batch over a snapshot, then the next batch over the same snapshot and the first's
    rows (planning ahead), as the Python rules make them."""
    first, first_reference = BlockRows(snapshot), ReferenceRows(snapshot)
    _apply(first, first_reference, base)
    sealed = first.sealed()
    assert sealed is first and sealed.items() == first_reference.items()
    _apply(BlockRows(snapshot, sealed), ReferenceRows(snapshot, first_reference), batch)


@settings(max_examples=300, deadline=None)
@given(rows, rows)
def test_upgrades_is_the_rule(known: BlockRow, new: BlockRow) -> None:
    assert upgrades(known, new) == reference_upgrades(known, new)


def test_a_conflict_keeps_nothing_of_the_event() -> None:
    native = BlockRows({})
    assert native.store("m", 0, (b"a",), (1, 2), 2, 0, None, False, None, None, 5) is None
    why = native.store("m", 0, (b"b", b"a"), (3, 4, 1, 2), 2, 0, None, False, "x", None, 6)
    assert why == "same hash announced with a different parent: hash 61"
    assert [key for key, _, _ in native.items()] == [("m", 0, b"a")]  # no row for b"b"
    assert native.items()[0][2] == (None, None, 5, 5, False)  # nor its LoRA name or time


def test_an_install_without_the_core_says_the_planner_needs_it() -> None:
    said = import_error("kvledger.consumer.core.plan")
    assert said.startswith("MissingCoreError the index's planner needs kvledger's compiled core")
    assert "Rust toolchain (cargo)" in said
