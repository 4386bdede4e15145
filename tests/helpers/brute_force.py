"""The brute-force twin of the SQL prefix match, over the reference index."""

from __future__ import annotations

from datetime import datetime

from kvledger.consumer.lookup import Holder
from kvledger.fleet import DEFAULT_MODEL
from tests.helpers.reference_index import Reference

MODEL = DEFAULT_MODEL


def held_now(ref: Reference) -> set[tuple[object, ...]]:
    return set(ref.residencies())


def held_at(ref: Reference, at: datetime) -> set[tuple[object, ...]]:
    held = set()
    for row in ref.history_multiset():
        *key, stored, removed = row
        if stored <= at and (removed is None or removed > at):
            held.add(tuple(key))
    return held


def brute_force(ref: Reference, hashes: list[bytes], held: set[tuple[object, ...]]) -> set[Holder]:
    holders = {k[3:] for k in held if k[0] == MODEL and k[1] == 0}
    out = set()
    for instance, medium, ownership in holders:
        n = 0
        while n < len(hashes) and (MODEL, 0, hashes[n], instance, medium, ownership) in held:
            n += 1
        if n:
            row = ref.blocks.get((MODEL, 0, hashes[n - 1]))
            end = row[1] + len(row[2]) if row and row[1] is not None else 0
            out.add(Holder(instance, medium, ownership, n, end))
    return out
