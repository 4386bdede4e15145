"""What the index offered a router for a prompt, taken when the router reports where it
sent it (``POST /v1/decisions``), as the record the decisions topic carries to PostgreSQL
(:class:`kvledger.serving.router.decisions.Record`).

*Available* is the most leading blocks any live holder had, on any tier (its tier is the
best one holding that much); *captured* is what the chosen instance had, on its best tier;
*silent* the most any silent holder had. The record keeps the hashes of the captured
blocks (at most :data:`MAX_CAPTURED_HASHES`), from which the database tells what the engine
then delivered (migration 0018's decision_outcomes): for a prompt reported by block hashes,
its own; for one reported by token ids, the engine's hashes of the blocks the chosen
instance holds on its best tier, as the index's walk by tokens finds them.

An answer of Dynamo's ``/query`` is recorded too (:func:`answer_record`), with no chosen
instance: Dynamo's routers choose after the answer and tell nobody.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from kvledger.schemas.decisions import Offer, Record
from kvledger.schemas.lookup import Holder

if TYPE_CHECKING:
    from kvledger.serving.lookup.requests import DecisionRequest
    from kvledger.serving.router.index import RouterIndex

MAX_CAPTURED_HASHES = 8192
MAX_OFFERS = 1024
# Tiers from the fastest: a holder's best tier is the first it holds the most blocks on.
_TIER_ORDER = {"GPU": 0, "CPU": 1, "STORAGE": 2}
# A Dynamo answer's tiers, each counting the faster ones too (its "cpu": on GPU or CPU).
_DYNAMO_TIERS = (("gpu", "GPU"), ("cpu", "CPU"), ("disk", "STORAGE"))


def offer_record(
    router: RouterIndex,
    req: DecisionRequest,
    block_size: int,
    chosen_state: str,
    window: timedelta | None,
) -> Record:
    """The record of ``req``'s decision, from the index as it is now."""
    if req.token_ids is None:
        assert req.hashes is not None
        holders = router.match(req.model, req.group_idx, req.hashes, "block", True, window)
        return build_record(
            holders, req.instance, chosen_state, block_size, len(req.hashes), req.hashes
        )
    holders = router.match_tokens(
        req.model, req.group_idx, req.token_ids, req.lora_name, True, window, req.cache_salt
    )
    record = build_record(
        holders, req.instance, chosen_state, block_size, len(req.token_ids) // block_size, None
    )
    chosen = _best_holder([h for h in holders if h.instance == req.instance])
    if chosen is not None:  # the engine's hashes of what the chosen instance holds
        holder = (chosen.instance, chosen.medium, chosen.ownership)
        path = router.held_path(
            req.model, req.group_idx, req.token_ids, req.lora_name, req.cache_salt, holder
        )
        kept = path[: min(chosen.matched_blocks, MAX_CAPTURED_HASHES)]
        record.captured_hashes = [h.hex() for h in kept]
    return record


def answer_record(
    body: bytes, names: Mapping[int, str], block_size: int, prompt_blocks: int
) -> Record:
    """The record of a Dynamo ``/query`` answer ``body`` (pure): each worker in it, named by
    its instance (``names``: worker id -> instance), offered the blocks the answer gives it
    on each tier. The answer leaves silent instances out, so none is counted."""
    holders = []
    for worker, tiers in json.loads(body)["instances"].items():
        name = names.get(int(worker), f"worker {worker}")
        faster = 0
        for field, medium in _DYNAMO_TIERS:
            blocks = int(tiers[field]) // block_size
            if blocks > faster:  # more than the faster tiers held: held here
                holders.append(Holder(name, medium, "", blocks, blocks * block_size))
                faster = blocks
    return build_record(holders, None, None, block_size, prompt_blocks, None)


def build_record(  # noqa: PLR0913 - a record's facts, each named at its two call sites
    holders: Sequence[Holder],
    chosen: str | None,
    chosen_state: str | None,
    block_size: int,
    prompt_blocks: int,
    hashes: Sequence[bytes] | None,
) -> Record:
    """The record of a decision for ``chosen`` given the index's ``holders`` (pure);
    ``chosen`` None: an answer no choice was reported for (nothing captured is known)."""
    live = [h for h in holders if h.source_state == "live"]
    available, available_tier = _best(live)
    captured, captured_tier = _best([h for h in holders if h.instance == chosen])
    silent, _ = _best([h for h in holders if h.source_state != "live"])
    offered = [
        Offer(h.instance, h.medium, h.ownership, h.matched_blocks, h.source_state)
        for h in holders[:MAX_OFFERS]
    ]
    kept = None
    if hashes is not None and chosen is not None:
        kept = [h.hex() for h in hashes[: min(captured, MAX_CAPTURED_HASHES)]]
    return Record(
        id=uuid.uuid4().hex,
        at=time.time(),
        chosen_state=chosen_state,
        block_size=block_size,
        prompt_blocks=prompt_blocks,
        available_blocks=available,
        captured_blocks=None if chosen is None else captured,
        silent_blocks=silent,
        offered=offered,
        available_tier=available_tier,
        captured_tier=captured_tier,
        captured_hashes=kept,
        first_hash=hashes[0].hex() if hashes else None,
        last_hash=hashes[-1].hex() if hashes else None,
    )


def _best(holders: Sequence[Holder]) -> tuple[int, str | None]:
    """The most leading blocks among ``holders`` and the fastest tier holding that many."""
    best = _best_holder(holders)
    return (0, None) if best is None else (best.matched_blocks, best.medium)


def _best_holder(holders: Sequence[Holder]) -> Holder | None:
    """The holder of the most leading blocks among ``holders``, on the fastest tier (None:
    none holds any)."""
    most = max((h.matched_blocks for h in holders), default=0)
    if most == 0:
        return None
    return min(
        (h for h in holders if h.matched_blocks == most), key=lambda h: _TIER_ORDER.get(h.medium, 9)
    )
