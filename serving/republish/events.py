"""kvledger's index as vLLM KV events: the maps and batches a vLLM 0.33 engine publishes.

A router that subscribes to an engine's ZMQ stream reads a batch ``[ts, events, rank]`` of
tagged maps (shared/VLLM_FACTS.md). Here those maps are made from what the index applied:

- an event the router lane applied whole (:func:`stored_map`, :func:`removed_map`);
- a plan's residency changes: a residency that opened is a store of its block as the index
  holds it, one that ended is a removal (:func:`delta_maps`);
- a holder's whole holdings, each run of chained blocks as one store, parents before
  children (:func:`chain_maps`): what a subscriber is told after ``AllBlocksCleared`` to
  hold exactly what the index holds.

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


# A held block as read from its group: its row and its LoRA name.
Blocks = dict[bytes, tuple[Row, str | None]]


def read_blocks(group: Any, hashes: Iterable[bytes]) -> Blocks:
    """What :func:`chain_maps` needs of ``hashes`` (a group's ``row`` and ``meta``; read
    under the lock the group's writer takes), partial blocks left out."""
    out: Blocks = {}
    for h in hashes:
        row = group.row(h)
        if row is not None and not row[4]:
            meta = group.meta(h)
            out[h] = (row, meta[0] if meta else None)
    return out


def _joins(row: Row, lora: str | None, first: tuple[Row, str | None]) -> bool:
    """Whether a block can follow a run begun by ``first`` in one event: full blocks of
    the same size and LoRA name (a placeholder, without tokens, stands alone)."""
    size = first[0][3]
    return lora == first[1] and row[3] == size and size > 0 and len(row[2]) == size


def chain_maps(blocks: Blocks, medium: str, group_idx: int, ownership: str) -> list[dict[str, Any]]:
    """A holder's blocks as stores, one per run of blocks that chain parent to child (as
    an engine stores a prompt's), every run after the run that holds its parent."""
    children: dict[bytes, list[bytes]] = {}
    roots = []
    for h, (row, _) in blocks.items():
        parent = row[0]
        if parent is not None and parent != h and parent in blocks:
            children.setdefault(parent, []).append(h)
        else:
            roots.append(h)
    out: list[dict[str, Any]] = []
    seen: set[bytes] = set()
    # Roots first; then whatever a cycle left unreached (no engine makes one).
    for start in [*roots, *blocks]:
        todo = [start]
        while todo:
            first = todo.pop()
            if first in seen:
                continue
            run, x = [first], first
            seen.add(first)
            head = blocks[first]
            while True:
                kids = [k for k in children.get(x, ()) if k not in seen]
                if len(kids) == 1 and _joins(*blocks[kids[0]], head):
                    x = kids[0]
                    seen.add(x)
                    run.append(x)
                    continue
                todo.extend(kids)
                break
            out.append(_stored(run, blocks, medium, group_idx, ownership))
    return out


def _stored(
    run: list[bytes], blocks: Blocks, medium: str, group_idx: int, ownership: str
) -> dict[str, Any]:
    (parent, _, tokens, block_size, _), lora = blocks[run[0]]
    if len(run) > 1:
        tokens = [t for h in run for t in blocks[h][0][2]]
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [wire_hash(h) for h in run],
        "parent_block_hash": None if parent is None else wire_hash(parent),
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora,
    }
    return _tail(out, group_idx, ownership)


def holdings_maps(
    group: Any, hashes: Iterable[bytes], medium: str, group_idx: int, ownership: str
) -> list[dict[str, Any]]:
    """A holder's blocks as stores, parents first (:func:`chain_maps`)."""
    return chain_maps(read_blocks(group, hashes), medium, group_idx, ownership)


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
                {
                    "type": "BlockRemoved",
                    "block_hashes": [wire_hash(k.block_hash)],
                    "medium": k.medium,
                },
                k.group_idx,
                k.ownership,
            )
        elif d.before == 0 and d.refcount > 0:
            opened.setdefault((k.model, k.group_idx, k.medium, k.ownership), []).append(
                k.block_hash
            )
    for (model, group_idx, medium, ownership), hashes in opened.items():
        g = groups.get((model, group_idx))
        if g is not None:
            yield from holdings_maps(g, hashes, medium, group_idx, ownership)
