"""NVIDIA Dynamo's hashing of a prompt's blocks, as its KV router keys its index.

Dynamo's router keys its tree by a local hash per full block of ``block_size`` tokens:
XXH3-64 over the block's token ids as little-endian unsigned 32-bit ints, under a seed
of 1337, to which a LoRA adapter's name adds XXH3-64 of the name (seed 0) and a cache
namespace XXH3-64 of the namespace (seed 1), wrapping at 64 bits; an empty name counts as
none. These are the values of ``compute_block_hash_for_seq`` in Dynamo 1.6.1 (crate
``dynamo-kv-router``, the ``ai-dynamo-runtime`` wheel); tests/unit/test_dynamo_hashing.py
holds them to the wheel's on every block of a simulated fleet. Not covered: EAGLE's shifted
windows and multimodal blocks (Dynamo mixes each block's media hashes in).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

_SEED = 1337
_MASK = (1 << 64) - 1
_PACKERS: dict[int, struct.Struct] = {}


def dynamo_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """The XXH3 seed of a prompt's block hashes, for its LoRA adapter and cache namespace."""
    seed = _SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode(), seed=0)
    if cache_namespace:
        seed += xxhash.xxh3_64_intdigest(cache_namespace.encode(), seed=1)
    return seed & _MASK


def dynamo_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
) -> list[int]:
    """Dynamo's local hash of each full block of ``tokens`` (a partial last block has none)."""
    if block_size <= 0:
        return []
    packer = _PACKERS.get(block_size)
    if packer is None:
        packer = _PACKERS[block_size] = struct.Struct(f"<{block_size}I")
    seed = dynamo_seed(lora_name, cache_namespace)
    digest = xxhash.xxh3_64_intdigest
    return [
        digest(packer.pack(*(t & 0xFFFFFFFF for t in tokens[i : i + block_size])), seed=seed)
        for i in range(0, len(tokens) - block_size + 1, block_size)
    ]


def packed_block_hashes(packed: bytes, block_size: int, seed: int) -> list[int]:
    """:func:`dynamo_block_hashes` of token ids already packed as u32 LE bytes, under
    ``seed`` (:func:`dynamo_seed`)."""
    if block_size <= 0:
        return []
    width, digest = block_size * 4, xxhash.xxh3_64_intdigest
    ends = range(width, len(packed) + 1, width)
    return [digest(packed[end - width : end], seed=seed) for end in ends]
