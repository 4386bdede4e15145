"""The compiled core's residencies (``kvledger._core.Residencies``, through the planner's
``References``) against the reference counts in plain Python
(tests/helpers/reference_refs.py), on random stores, removals and scope-wide endings over
a few holders and hashes: every answer and every changed residency, with and without the
batch before planned ahead of it."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.consumer.core.compact import from_micros, micros
from kvledger.consumer.core.model import (
    HolderKey,
    HolderScope,
    Plan,
    Residency,
    ResidencyKey,
    Snapshot,
)
from kvledger.consumer.core.refs import References
from kvledger.consumer.inbound import Inbound
from tests.helpers.reference_refs import References as ReferenceRefs

HOLDERS = [
    HolderKey("m", g, i, medium, o)
    for g in (0, 1)
    for i in ("e0", "e1")
    for medium in ("GPU", "CPU")
    for o in ("", "x")
]
HASHES = (b"a", b"b", b"c")
times = st.integers(1_700_000_000_000_000, 1_700_000_000_000_100).map(from_micros)
messages = st.builds(
    Inbound,
    st.sampled_from(["t", "u"]),
    st.integers(0, 2),
    st.integers(0, 50),
    st.none(),
    st.just(b""),
)
localities = st.one_of(st.none(), st.sampled_from(["near", "far"]))
held_rows = st.dictionaries(
    st.tuples(st.sampled_from(HOLDERS), st.sampled_from(HASHES)),
    st.builds(
        Residency,
        st.integers(1, 3),
        localities,
        times,
        st.sampled_from(["t", "u"]),
        st.integers(0, 2),
        st.integers(0, 50),
    ),
    max_size=8,
)
scopes = st.builds(
    HolderScope,
    st.just("m"),
    st.one_of(st.none(), st.sampled_from([0, 1])),
    st.sampled_from(["e0", "e1"]),
    st.one_of(st.none(), st.sampled_from(["GPU"])),
    st.one_of(st.none(), st.just("x")),
)
ops = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from(HOLDERS),
        st.lists(st.sampled_from(HASHES), min_size=1, max_size=3).map(tuple),
        times,
        localities,
        messages,
        st.booleans(),
    ),
    st.tuples(
        st.just("remove"),
        st.sampled_from(HOLDERS),
        st.lists(st.sampled_from(HASHES), min_size=1, max_size=3).map(tuple),
        times,
        localities,
        messages,
    ),
    st.tuples(st.just("end"), scopes, st.sampled_from(["cleared", "lost"]), times, messages),
)


def _snapshot(rows: dict, history: bool) -> Snapshot:  # type: ignore[type-arg]
    residencies = {ResidencyKey(*holder[:2], h, *holder[2:]): r for (holder, h), r in rows.items()}
    held: dict[HolderKey, set[bytes]] = {}
    for holder, h in rows:
        held.setdefault(holder, set()).add(h)
    return Snapshot({}, {}, residencies, held, {}, {}, history=history)


def _run(native: References, reference: ReferenceRefs, batch: list) -> None:  # type: ignore[type-arg]
    for op in batch:
        if op[0] == "store":
            _, holder, hashes, when, locality, msg, reports = op
            reused = 0
            for h in hashes:  # as the planner did, before the core
                key = ResidencyKey(*holder[:2], h, *holder[2:])
                if reports and reference.count(key) > 0:
                    reused += 1
                else:
                    reference.change(key, 1, when, locality, msg)
            assert native.store(holder, hashes, micros(when), locality, msg, reports) == reused
        elif op[0] == "remove":
            _, holder, hashes, when, locality, msg = op
            keys = [ResidencyKey(*holder[:2], h, *holder[2:]) for h in hashes]
            noop = sum(not reference.change(k, -1, when, locality, msg) for k in keys)
            assert native.remove(holder, hashes, when, locality, msg) == noop
        else:
            _, scope, how, when, msg = op
            assert native.live(scope) == reference.live(scope)
            ended = reference.end(reference.live(scope), how, when, msg)
            assert native.end(native.live(scope), how, when, msg) == ended


def _deltas(native: References) -> list:  # type: ignore[type-arg]
    return Plan(refs=native.native).residencies  # in the order first changed, as the reference


def _overlaid(snap: Snapshot, before: ReferenceRefs) -> Snapshot:
    """``snap`` as the batch ``before`` left it (as consumer/ahead.py laid it over before the
    core held the residencies)."""
    residencies, held = dict(snap.residencies), {k: set(v) for k, v in snap.held.items()}
    for d in before.touched():
        if d.refcount > 0:
            residencies[d.key] = Residency(
                d.refcount,
                d.locality,
                d.since,
                d.topic,  # type: ignore[arg-type]
                d.partition,
                d.offset,
            )
            held.setdefault(d.key.holder, set()).add(d.key.block_hash)
        else:
            residencies.pop(d.key, None)
    return dataclasses.replace(snap, residencies=residencies, held=held)


def _copied_keys(data: bytes | None) -> list[ResidencyKey]:
    """The keys (the first six fields, never NULL) of binary COPY data's rows."""
    keys: list[ResidencyKey] = []
    at = 19  # signature, flags, header extension
    while data is not None and data[at : at + 2] != b"\xff\xff":  # the trailer: -1
        fields, at = int.from_bytes(data[at : at + 2], "big"), at + 2
        values: list[bytes] = []
        for _ in range(fields):
            size, at = int.from_bytes(data[at : at + 4], "big", signed=True), at + 4
            values.append(data[at : at + max(size, 0)])
            at += max(size, 0)
        model, group, block, *holder = values[:6]
        keys.append(ResidencyKey(model.decode(), int.from_bytes(group, "big"), block,
                                 *(part.decode() for part in holder)))  # fmt: skip
    return keys


def _check_copies(native: References, reference: ReferenceRefs, held: Snapshot) -> None:
    """The residencies to write, split as the PostgreSQL store writes them: those new to
    the store (``held``) with a reference, copied straight in; the rest, merged."""
    refs = native.native
    touched = {d.key: d.refcount for d in reference.touched()}
    new = _copied_keys(refs.copy_holders(False))
    assert set(new) == {k for k, n in touched.items() if n > 0 and k not in held.residencies}
    both = sorted(new + _copied_keys(refs.copy_holders(True)))
    assert both == sorted(_copied_keys(refs.copy_holders()))


@settings(max_examples=300, deadline=None)
@given(held_rows, st.booleans(), st.lists(ops, max_size=8), st.lists(ops, max_size=8))
def test_residencies_count_as_the_rules_count(
    rows: dict,
    history: bool,
    first: list,
    then: list,  # type: ignore[type-arg]
) -> None:
    snap = _snapshot(rows, history)
    native, reference = References(snap), ReferenceRefs(snap)
    _run(native, reference, first)
    assert _deltas(native) == reference.touched()
    _check_copies(native, reference, snap)
    sealed = native.native.sealed()
    ahead = dataclasses.replace(snap, residency_base=sealed)
    overlaid = _overlaid(snap, reference)
    native_next, reference_next = References(ahead), ReferenceRefs(overlaid)
    _run(native_next, reference_next, then)
    assert _deltas(native_next) == reference_next.touched()
    _check_copies(native_next, reference_next, overlaid)
