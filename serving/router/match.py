"""Prefix matches over the router's store: the SQL lookup functions' answers, in memory.

Each mirrors its SQL twin (serving/lookup/sql/): ``held_prefix`` (block and hash
granularity), ``held_tokens`` (the token walk through full blocks, then partial tails) and
the liveness filter of ``match_prefix`` / ``match_tokens``. A holder's run is the longest
stretch of positions 1, 2, ... it covers; the group (store.py) walks a whole prompt at
once: with holders as bits, each position costs one AND over everyone still running.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from kvledger.consumer.core.model import GroupKey, SourceLife
from kvledger.schemas.lookup import EngineLoad, Holder
from kvledger.serving.router.store import RouterStore

DEFAULT_SILENT_AFTER = timedelta(seconds=30)
Run = tuple[int, int, int]  # (holder id, matched_blocks, matched_tokens)


def held_prefix(
    store: RouterStore, model: str, group: int, hashes: Sequence[bytes], granularity: str
) -> list[Run]:
    g = store.groups.get(GroupKey(model, group))
    if g is None or not hashes:
        return []
    if granularity == "block":
        return g.runs(hashes)
    if granularity != "hash":
        raise ValueError(f"granularity must be block or hash, not {granularity!r}")
    held = store.specs.get(GroupKey(model, group))
    if held is None:
        return []
    spec = held.spec
    if spec.hash_block_size <= 0 or spec.block_size <= 0 or spec.block_size % spec.hash_block_size:
        return []
    ratio = spec.block_size // spec.hash_block_size
    # position i + 1: its own hash, or the end of the block it is in
    found = g.runs_covered(hashes, ratio)
    return [(hid, n // ratio, n * spec.hash_block_size) for hid, n in found]


def held_tokens(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
    store: RouterStore,
    model: str,
    group: int,
    tokens: Sequence[int],
    lora: str | None,
    salt: str | None = None,
) -> list[Run]:
    """The token walk of ``held_tokens``: full blocks from the start (the first under the
    cache salt ``salt``), then partial tails (one call into the group:
    :meth:`~.store.BlockGroup.match_tokens`)."""
    held = store.specs.get(GroupKey(model, group))
    g = store.groups.get(GroupKey(model, group))
    if held is None or g is None:
        return []
    return g.match_tokens(tokens, held.spec.block_size, held.spec.hash_block_size, lora, salt)


def held_path(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
    store: RouterStore,
    model: str,
    group: int,
    tokens: Sequence[int],
    lora: str | None,
    salt: str | None,
    holder: tuple[str, str, str],
) -> list[bytes]:
    """The engine's hashes of the prompt's leading full blocks that ``holder`` (instance,
    medium, ownership) holds, as the token walk finds them (:meth:`Group.held_path`)."""
    held = store.specs.get(GroupKey(model, group))
    g = store.groups.get(GroupKey(model, group))
    hid = store.holder_ids.get(holder)
    if held is None or g is None or hid is None:
        return []
    return g.held_path(tokens, held.spec.block_size, lora, hid, salt)


def state_of(life: SourceLife | None, now: datetime, silent_after: timedelta) -> str:
    """live | silent | closed | unknown, as kvledger.source_state answers."""
    if life is None:
        return "unknown"
    if life.closed_at is not None:
        return "closed"
    return "live" if is_live(life, now - silent_after) else "silent"


def is_live(life: SourceLife | None, cut: datetime) -> bool:
    """Whether :func:`state_of` is live, given ``cut`` = now - silent_after (one
    subtraction per request, not per source)."""
    return life is not None and life.closed_at is None and not life.last_seen < cut


def loads(
    lives: Mapping[str, SourceLife], model: str, now: datetime, silent_after: timedelta | None
) -> list[EngineLoad]:
    """The load of each live source of ``model`` that has said one, by instance (as
    :meth:`~kvledger.serving.lookup.api.PrefixIndex.loads` answers from the sources table)."""
    cut = now - (silent_after if silent_after is not None else DEFAULT_SILENT_AFTER)
    return sorted(
        (
            EngineLoad(source, life.requests_running, life.requests_waiting, life.load_at)
            for source, life in lives.items()
            if life.load_at is not None and life.model == model and is_live(life, cut)
        ),
        key=lambda load: load.instance,
    )


def answer(
    store: RouterStore,
    found: list[Run],
    include_silent: bool,
    silent_after: timedelta | None,
    now: datetime,
) -> list[Holder]:
    """Holders in the lookup API's order, with their source's state, filtered unless asked."""
    window = silent_after if silent_after is not None else DEFAULT_SILENT_AFTER
    out = []
    for hid, blocks, tokens in found:
        instance, medium, ownership = store.holders[hid]
        state = state_of(store.lives.get(instance), now, window)
        if include_silent or state == "live":
            out.append(Holder(instance, medium, ownership, blocks, tokens, state))
    out.sort(key=holder_order)
    return out


def holder_order(h: Holder) -> tuple[int, int, str, str, str]:
    """The lookup API's order of holders (the SQL functions' ORDER BY): the longest match
    first, then by name."""
    return (-h.matched_tokens, -h.matched_blocks, h.instance, h.medium, h.ownership)
