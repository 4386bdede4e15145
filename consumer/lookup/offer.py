"""What the index offered a router for a prompt, taken when the router reports where it
sent it (``POST /v1/decisions``), as the record the decisions topic carries to PostgreSQL
(:class:`kvledger.consumer.router.decisions.Record`).

*Available* is the most leading blocks any live holder had, on any tier (its tier is the
best one holding that much); *captured* is what the chosen instance had, on its best tier;
*silent* the most any silent holder had. For a prompt reported by block hashes the record
keeps the hashes of its captured blocks (at most :data:`MAX_CAPTURED_HASHES`), from which
the database tells what the engine then delivered (migration 0018's decision_outcomes).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from kvledger.consumer.router.decisions import Offer, Record
from kvledger.schemas.lookup import Holder

if TYPE_CHECKING:
    from kvledger.consumer.lookup.requests import DecisionRequest
    from kvledger.consumer.router.index import RouterIndex

MAX_CAPTURED_HASHES = 8192
MAX_OFFERS = 1024
# Tiers from the fastest: a holder's best tier is the first it holds the most blocks on.
_TIER_ORDER = {"GPU": 0, "CPU": 1, "STORAGE": 2}


def offer_record(
    router: RouterIndex,
    req: DecisionRequest,
    block_size: int,
    chosen_state: str,
    window: timedelta | None,
) -> Record:
    """The record of ``req``'s decision, from the index as it is now."""
    if req.token_ids is not None:
        holders = router.match_tokens(req.model, req.group_idx, req.token_ids, req.lora_name,
                                      True, window, req.cache_salt)  # fmt: skip
        prompt_blocks = len(req.token_ids) // block_size
    else:
        assert req.hashes is not None
        holders = router.match(req.model, req.group_idx, req.hashes, "block", True, window)
        prompt_blocks = len(req.hashes)
    return build_record(holders, req.instance, chosen_state, block_size, prompt_blocks,
                        req.hashes)  # fmt: skip


def build_record(
    holders: Sequence[Holder],
    chosen: str,
    chosen_state: str,
    block_size: int,
    prompt_blocks: int,
    hashes: Sequence[bytes] | None,
) -> Record:
    """The record of a decision for ``chosen`` given the index's ``holders`` (pure)."""
    live = [h for h in holders if h.source_state == "live"]
    available, available_tier = _best(live)
    captured, captured_tier = _best([h for h in holders if h.instance == chosen])
    silent, _ = _best([h for h in holders if h.source_state != "live"])
    offered = [
        Offer(h.instance, h.medium, h.ownership, h.matched_blocks, h.source_state)
        for h in holders[:MAX_OFFERS]
    ]
    kept = None
    if hashes is not None:
        kept = [h.hex() for h in hashes[: min(captured, MAX_CAPTURED_HASHES)]]
    return Record(
        id=uuid.uuid4().hex, at=time.time(), chosen_state=chosen_state, block_size=block_size,
        prompt_blocks=prompt_blocks, available_blocks=available, captured_blocks=captured,
        silent_blocks=silent, offered=offered, available_tier=available_tier,
        captured_tier=captured_tier, captured_hashes=kept,
        first_hash=hashes[0].hex() if hashes else None,
        last_hash=hashes[-1].hex() if hashes else None,
    )  # fmt: skip


def _best(holders: Sequence[Holder]) -> tuple[int, str | None]:
    """The most leading blocks among ``holders`` and the fastest tier holding that many."""
    best = max((h.matched_blocks for h in holders), default=0)
    if best == 0:
        return 0, None
    tiers = [h.medium for h in holders if h.matched_blocks == best]
    return best, min(tiers, key=lambda m: _TIER_ORDER.get(m, 9))
