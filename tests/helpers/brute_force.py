"""The brute-force twins of the prefix lookups, over the reference index: by block hashes,
by the engine's hashes and by token content; and the prompts that put them to the test."""

from __future__ import annotations

import random
from datetime import datetime

from kvledger.fleet import DEFAULT_MODEL, FleetConfig, random_tokens, system_prompts
from kvledger.serving.lookup import Holder
from tests.helpers.reference_index import Reference

MODEL = DEFAULT_MODEL
BLOCK = 32  # the fleet's block size
HASH = 16  # the fleet's hash size (TOKENS_PER_HASH)


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


def brute_force_hashes(
    raw: list[bytes], held: set[tuple[object, ...]], hash_size: int = HASH
) -> set[Holder]:
    """The hash-granularity answer: position i is covered when its hash is held (a partial
    tail row) or when the hash ending its block is (a full block)."""
    ratio = BLOCK // hash_size
    holders = {k[3:] for k in held if k[0] == MODEL and k[1] == 0}
    out = set()
    for instance, medium, ownership in holders:
        holder = (instance, medium, ownership)
        mine = {k[2] for k in held if k[:2] == (MODEL, 0) and k[3:] == holder}
        n = 0
        while n < len(raw):
            end = (n // ratio + 1) * ratio  # block end of position n (0-based), exclusive
            if raw[n] not in mine and not (end <= len(raw) and raw[end - 1] in mine):
                break
            n += 1
        if n:
            out.add(Holder(instance, medium, ownership, n // ratio, n * hash_size))
    return out


def chain_by_tokens(
    ref: Reference, tokens: list[int], hash_size: int = HASH
) -> tuple[list[bytes], int]:
    """Walk the reference's rows by token content as match_tokens must: full blocks from the
    start, then partial-tail rows at hash granularity. Returns the chain and how many of it
    are full blocks."""
    children: dict[tuple[bytes | None, bool], list[tuple[bytes, tuple[object, ...]]]] = {}
    for (model, group, h), row in ref.blocks.items():
        if (
            model == MODEL
            and group == 0
            and (row[3], row[4]) in ((BLOCK, False), (hash_size, True))
        ):
            children.setdefault((row[0], bool(row[4])), []).append((h, row))  # type: ignore[arg-type]
    chain: list[bytes] = []
    parent: bytes | None = None
    pos = 0
    full = 0
    for partial, size in ((False, BLOCK), (True, hash_size)):
        while pos + size <= len(tokens):
            want = tuple(tokens[pos : pos + size])
            nxt = sorted(h for h, row in children.get((parent, partial), []) if row[2] == want)
            if not nxt:
                break
            parent = nxt[0]
            chain.append(parent)
            pos += size
        if not partial:
            full = len(chain)
    return chain, full


def prompts(ref: Reference, fleet: FleetConfig, rng: random.Random) -> list[list[int]]:
    """System prompts with new suffixes, and prompts rebuilt from stored chains."""
    out = [p + random_tokens(rng, rng.randint(0, 200)) for p in system_prompts(fleet)]
    full = [
        (h, row) for (m, g, h), row in ref.blocks.items()
        if m == MODEL and g == 0 and row[3] == BLOCK and not row[4]
    ]  # fmt: skip
    for _, row in rng.sample(full, 25):
        tokens: list[int] = []
        cur: tuple[object, ...] | None = row
        while cur is not None:
            tokens = list(cur[2]) + tokens  # type: ignore[call-overload]
            parent = cur[0]
            cur = ref.blocks.get((MODEL, 0, parent)) if parent is not None else None  # type: ignore[arg-type]
            if cur is not None and (cur[3] != BLOCK or cur[4]):
                break
        out.append(tokens + random_tokens(rng, rng.randint(0, 64)))
    held_hashes = {k[2] for k in ref.residencies() if k[0] == MODEL and k[1] == 0}
    tails = [
        row for (m, g, h), row in ref.blocks.items()
        if m == MODEL and g == 0 and row[4] and h in held_hashes
    ]  # fmt: skip
    for row in rng.sample(tails, min(15, len(tails))):  # prompts ending in a partial tail
        tokens = []
        cur = row
        while cur is not None:
            tokens = list(cur[2]) + tokens  # type: ignore[call-overload]
            cur = ref.blocks.get((MODEL, 0, cur[0])) if cur[0] is not None else None  # type: ignore[arg-type]
        out.append(tokens)
    out.append(random_tokens(rng, 300))  # nobody holds it
    return out
