"""SGLang's KV event batches as its ZMQ publisher sends them (pure; no sockets), read into
kvledger's events for `kvledger relay --engine sglang`.

SGLang 0.5.23 (``sglang/srt/disaggregation/kv_events.py``) frames and replays its batches
as vLLM does (``[topic, seq, payload]``; replay over a ROUTER socket, the end marker seq
-1), so the relay's guarantees carry over unchanged. The payload differs:

- a batch is ``[ts, events, attn_dp_rank]``; each event a tagged map (``type`` first):
  ``BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  cache_salt, session_id, lora_name}``, ``BlockRemoved {block_hashes, medium}``,
  ``AllBlocksCleared``; no KV-cache groups (everything is group 0);
- block hashes are signed 64-bit ints: kvledger keeps the same 8 bytes (two's complement,
  big-endian), so ``-1`` and ``18446744073709551615`` are one hash;
- media: ``GPU`` is GPU, ``CPU_PINNED`` is CPU, ``DISK`` is STORAGE, and ``EXTERNAL`` (a
  shared pool such as Mooncake) is STORAGE with ownership ``external``: it is storage the
  engine reads from, outlives the engine like its disk, and the ownership keeps it apart
  from the engine's own disk for lookups and audits. Any other medium is refused by name
  (the batch is recorded lost, as an undecodable one);
- a stored block's hash is namespaced by the request's ``cache_salt`` (SGLang hashes the
  salt in): kvledger carries the salt as the request's first block's extra key, untagged as
  vLLM sends it (``["<salt>"]``), so such blocks are found by their hashes or by a token
  walk given that salt (``cache_salt``), never by one without it; ``lora_name`` and
  ``session_id`` are carried as they are.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvledger.producer.relay.wire import TOO_DEEP, EngineBatch, checked
from kvledger.producer.vllm import VllmEventError, extra_keys_json, signed_hash_bytes
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

MEDIA: dict[str | None, tuple[str, str | None]] = {
    None: ("GPU", None),
    "GPU": ("GPU", None),
    "CPU_PINNED": ("CPU", None),
    "DISK": ("STORAGE", None),
    "EXTERNAL": ("STORAGE", "external"),
}


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    attn_dp_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)


def medium_of(medium: str | None) -> tuple[str, str | None]:
    """(kvledger's medium, ownership) of an SGLang medium."""
    try:
        return MEDIA[medium]
    except KeyError:
        known = ", ".join(m for m in MEDIA if m)
        raise VllmEventError(f"unknown SGLang medium {medium!r} (known: {known})") from None


def read_batch(payload: bytes) -> EngineBatch:
    """One SGLang batch payload as kvledger's events; raises :class:`VllmEventError` with
    the reason for one that is not SGLang's shape."""
    try:
        batch = _DECODER.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise VllmEventError(f"not an SGLang KV event batch: {exc}") from None
    except RecursionError:
        raise VllmEventError(TOO_DEEP) from None
    return checked(EngineBatch(batch.ts, [_event(e) for e in batch.events], batch.attn_dp_rank))


def _event(e: Any) -> KVEvent:
    if isinstance(e, _Stored):
        medium, ownership = medium_of(e.medium)
        hashes = tuple(signed_hash_bytes(h) for h in e.block_hashes)
        extra = None
        # The salt namespaces every hash of the request: kept on its first block, as vLLM
        # sends a salted request's (the later ones are reached through it).
        if e.cache_salt is not None and e.parent_block_hash is None and hashes:
            extra = extra_keys_json([[e.cache_salt]] + [None] * (len(hashes) - 1))
        try:
            return BlockStored(
                block_hashes=hashes,
                parent_block_hash=(
                    signed_hash_bytes(e.parent_block_hash)
                    if e.parent_block_hash is not None
                    else None
                ),
                token_ids=tuple(e.token_ids),
                block_size=e.block_size,
                lora_id=e.lora_id,
                medium=medium,
                lora_name=e.lora_name,
                extra_keys=extra,
                ownership=ownership,
                session_id=e.session_id,
            )
        except (TypeError, ValueError) as exc:
            raise VllmEventError(f"BlockStored: {exc}") from exc
    if isinstance(e, _Removed):
        medium, ownership = medium_of(e.medium)
        hashes = tuple(signed_hash_bytes(h) for h in e.block_hashes)
        return BlockRemoved(block_hashes=hashes, medium=medium, ownership=ownership)
    return AllBlocksCleared()
