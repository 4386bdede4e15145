"""The vLLM adapter: vLLM's KV cache event objects (BlockStored, BlockRemoved,
AllBlocksCleared, as its ``KVEventBatch.events`` hold them) mapped to kvledger's events.

Events are read by vLLM's field names (duck-typed: msgspec structs, dataclasses or any
object with those attributes); fields an older engine lacks take the contract's defaults.
Hashes may be ints (vLLM's default wire form) or bytes. Extra keys are carried per block as
canonical JSON text.
"""

from __future__ import annotations

import json
from typing import Any

from kvledger.schemas.events import (
    DEFAULT_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from kvledger.schemas.hashing import int_to_hash_bytes


def _hash_bytes(value: object) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, int):
        return int_to_hash_bytes(value)
    raise TypeError(f"a block hash must be int or bytes, got {type(value).__name__}")


def _extra_keys_json(extra: object) -> tuple[str | None, ...] | None:
    if extra is None:
        return None
    if not isinstance(extra, list | tuple):
        raise TypeError("extra_keys must be a list with one entry per block")
    return tuple(
        None if e is None else json.dumps(e, sort_keys=True, default=_json_default) for e in extra
    )


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def from_vllm_event(event: Any) -> KVEvent:
    """Map one vLLM KV cache event (BlockStored/BlockRemoved/AllBlocksCleared) to ours."""
    kind = type(event).__name__
    if kind == "BlockStored":
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=tuple(_hash_bytes(h) for h in event.block_hashes),
            parent_block_hash=_hash_bytes(parent) if parent is not None else None,
            token_ids=tuple(int(t) for t in event.token_ids),
            block_size=int(event.block_size),
            lora_id=getattr(event, "lora_id", None),
            medium=getattr(event, "medium", None),
            lora_name=getattr(event, "lora_name", None),
            extra_keys=_extra_keys_json(getattr(event, "extra_keys", None)),
            group_idx=getattr(event, "group_idx", None),
            kv_cache_spec_kind=getattr(event, "kv_cache_spec_kind", None),
            kv_cache_spec_sliding_window=getattr(event, "kv_cache_spec_sliding_window", None),
            locality=getattr(event, "locality", None),
            ownership=getattr(event, "ownership", None),
            token_start=getattr(event, "token_start", None),
            partial=bool(getattr(event, "partial", False)),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(_hash_bytes(h) for h in event.block_hashes),
            medium=getattr(event, "medium", None),
            group_idx=getattr(event, "group_idx", None),
            locality=getattr(event, "locality", None),
            ownership=getattr(event, "ownership", None),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(medium=getattr(event, "medium", None) or DEFAULT_MEDIUM)
    raise TypeError(f"not a vLLM KV cache event: {kind}")
