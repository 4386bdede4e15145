"""kvledger's index as vLLM KV events: the maps and batches a vLLM 0.33 engine publishes.

A router that subscribes to an engine's ZMQ stream reads a batch ``[ts, events, rank]`` of
tagged maps (shared/VLLM_FACTS.md). Here those maps are made from what the index applied:

- an event the router lane applied whole (:func:`stored_map`, :func:`removed_map`);
- a plan's residency changes: a residency that opened is a store of its block as the index
  holds it, one that ended is a removal (:func:`delta_maps`);
- a holder's whole holdings, parents before children (:func:`holdings_maps`): what a
  subscriber is told after ``AllBlocksCleared`` to hold exactly what the index holds.

Hashes go out as vLLM's int hashes where the index holds 8 bytes (vLLM's default, and what
SGLang and TensorRT-LLM relays store), as the raw digest otherwise. A partial block (a
tail shorter than the block) has no vLLM form and is not republished. Pure: no sockets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec

from kvledger.consumer.core.model import PRIMARY_OWNERSHIP, ResidencyDelta
from kvledger.schemas.events import DEFAULT_GROUP_IDX, DEFAULT_MEDIUM, BlockRemoved, BlockStored

CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}
_encoder = msgspec.msgpack.Encoder()

# (parent, token_start, tokens, block_size, partial): a block row as a group gives it.
Row = tuple[bytes | None, int | None, Sequence[int], int, bool]


def wire_hash(h: bytes) -> int | bytes:
    """A block hash as vLLM puts it on the wire."""
    return int.from_bytes(h, "big") if len(h) == 8 else h


def encode_batch(ts: float, events: Sequence[Mapping[str, Any]], dp_rank: int | None) -> bytes:
    """One batch payload, as vLLM's publisher encodes it (a rank not known: nil)."""
    return _encoder.encode([ts, events, dp_rank])


def _tail(
    event: dict[str, Any], group_idx: int, ownership: str | None, locality: str | None = None
) -> dict[str, Any]:
    """The optional fields vLLM leaves out at their defaults, in its order."""
    if group_idx != DEFAULT_GROUP_IDX:
        event["group_idx"] = group_idx
    if locality is not None:
        event["locality"] = locality
    if ownership and ownership != PRIMARY_OWNERSHIP:
        event["ownership"] = ownership
    return event


def stored_map(ev: BlockStored) -> dict[str, Any] | None:
    """An applied store as vLLM sent (or would send) it; None for a partial block."""
    if ev.partial:
        return None
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [wire_hash(h) for h in ev.block_hashes],
        "parent_block_hash": None
        if ev.parent_block_hash is None
        else wire_hash(ev.parent_block_hash),
        "token_ids": list(ev.token_ids),
        "block_size": ev.block_size,
        "lora_id": ev.lora_id,
        "medium": ev.medium if ev.medium is not None else DEFAULT_MEDIUM,
        "lora_name": ev.lora_name,
    }
    if ev.group_idx is not None and ev.group_idx != DEFAULT_GROUP_IDX:
        out["group_idx"] = ev.group_idx
    if ev.kv_cache_spec_kind is not None:
        out["kv_cache_spec_kind"] = ev.kv_cache_spec_kind
    if ev.kv_cache_spec_sliding_window is not None:
        out["kv_cache_spec_sliding_window"] = ev.kv_cache_spec_sliding_window
    if ev.locality is not None:
        out["locality"] = ev.locality
    if ev.ownership is not None:
        out["ownership"] = ev.ownership
    return out


def removed_map(ev: BlockRemoved, ended: Sequence[bytes]) -> dict[str, Any] | None:
    """An applied removal, of the hashes it ended (a block still held by another copy stays:
    vLLM's subscribers keep sets, the index counts copies); None when it ended none."""
    if not ended:
        return None
    group = ev.group_idx if ev.group_idx is not None else DEFAULT_GROUP_IDX
    out = {
        "type": "BlockRemoved",
        "block_hashes": [wire_hash(h) for h in ended],
        "medium": ev.medium if ev.medium is not None else DEFAULT_MEDIUM,
    }
    return _tail(out, group, ev.ownership, ev.locality)


def block_map(
    h: bytes, row: Row, lora_name: str | None, medium: str, group_idx: int, ownership: str
) -> dict[str, Any] | None:
    """One held block as a store of it alone; None for a partial block."""
    parent, _, tokens, block_size, partial = row
    if partial:
        return None
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [wire_hash(h)],
        "parent_block_hash": None if parent is None else wire_hash(parent),
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }
    return _tail(out, group_idx, ownership)


def parents_first(rows: Mapping[bytes, Row]) -> list[bytes]:
    """The hashes of ``rows`` ordered so that a block whose parent is among them comes
    after it (a subscriber's tree takes a child only under a parent it holds)."""
    depth: dict[bytes, int] = {}
    for h in rows:
        path: list[bytes] = []
        on_path: set[bytes] = set()
        x: bytes | None = h
        while x is not None and x in rows and x not in depth and x not in on_path:
            path.append(x)
            on_path.add(x)  # a cycle (no engine makes one) stops the walk
            x = rows[x][0]
        d = depth.get(x, -1) if x is not None else -1
        for y in reversed(path):
            d += 1
            depth[y] = d
    return sorted(rows, key=depth.__getitem__)


def holdings_maps(
    group: Any, hashes: Iterable[bytes], medium: str, group_idx: int, ownership: str
) -> Iterator[dict[str, Any]]:
    """A holder's blocks as stores, parents first."""
    rows: dict[bytes, Row] = {}
    for h in hashes:
        row = group.row(h)
        if row is not None:
            rows[h] = row
    for h in parents_first(rows):
        meta = group.meta(h)
        m = block_map(h, rows[h], meta[0] if meta else None, medium, group_idx, ownership)
        if m is not None:
            yield m


def delta_maps(
    deltas: Iterable[ResidencyDelta], groups: Mapping[Any, Any]
) -> Iterator[dict[str, Any]]:
    """A plan's residency changes for one source as events: removals of what ended, then
    stores of what opened (parents first). A count that moved between two non-zero values
    changes nothing a subscriber keeps."""
    opened: dict[tuple[str, int, str, str], list[bytes]] = {}
    for d in deltas:
        k = d.key
        if d.before > 0 and d.refcount == 0:
            yield _tail(
                {"type": "BlockRemoved", "block_hashes": [wire_hash(k.block_hash)],
                 "medium": k.medium},
                k.group_idx, k.ownership,
            )  # fmt: skip
        elif d.before == 0 and d.refcount > 0:
            opened.setdefault((k.model, k.group_idx, k.medium, k.ownership), []).append(
                k.block_hash
            )
    for (model, group_idx, medium, ownership), hashes in opened.items():
        g = groups.get((model, group_idx))
        if g is not None:
            yield from holdings_maps(g, hashes, medium, group_idx, ownership)
