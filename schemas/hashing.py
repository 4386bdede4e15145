"""vLLM-compatible prefix block hashing (matches vLLM 0.33.0, vllm/v1/core/kv_cache_utils.py).

A block's hash is ``H((parent or NONE_HASH, tuple(block_token_ids), extra_keys))`` for every
full window of ``hash_block_size`` tokens, where ``H`` is

- ``sha256``: SHA-256 of ``pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)`` (vLLM's default);
- ``sha256_cbor``: SHA-256 of ``cbor2.dumps(x, canonical=True)`` (language-independent);
- ``xxhash`` / ``xxhash_cbor``: the 16-byte XXH3-128 digest of the same serializations;

and ``NONE_HASH = H(seed)``, the seed being ``PYTHONHASHSEED`` when the engine had it set, else
``"vllm-none-hash"`` for the SHA-256 variants. For the xxhash variants an engine without
``PYTHONHASHSEED`` draws a random seed per process (they are not collision resistant), so
their hashes can be reproduced, and shared across engines, only with that seed set.
Extra keys are LoRA keys ``("lora", name, path)`` on every block, then
``("cache_salt", salt)`` on the block that starts at token 0; ``None`` when there are none.

On the wire vLLM publishes, by default, the digest's last 8 bytes (read big-endian as an
unsigned int64): :func:`to_int64_bytes` gives that form as bytes, the form kvledger stores.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_SEED_REQUIRED = frozenset({"xxhash", "xxhash_cbor"})


def sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def xxhash(value: Any) -> bytes:
    import xxhash as xx

    return xx.xxh3_128_digest(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(value: Any) -> bytes:
    import cbor2
    import xxhash as xx

    return xx.xxh3_128_digest(cbor2.dumps(value, canonical=True))


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    functions = {
        "sha256": sha256,
        "sha256_cbor": sha256_cbor,
        "xxhash": xxhash,
        "xxhash_cbor": xxhash_cbor,
    }
    try:
        return functions[algorithm]
    except KeyError:
        raise ValueError(
            f"unsupported hash algorithm {algorithm!r} (supported: {', '.join(ALGORITHMS)})"
        ) from None


def none_hash(algorithm: str = "sha256", seed: str | None = None) -> bytes:
    """The chain's root. ``seed``: the engine's PYTHONHASHSEED, or None when it had none."""
    if seed is None and algorithm in _SEED_REQUIRED:
        raise ValueError(
            f"{algorithm}: an engine without PYTHONHASHSEED roots its chains in a random "
            "per-process seed, which cannot be reproduced; start the engines with a shared "
            "PYTHONHASHSEED and pass it as the seed"
        )
    return hash_function(algorithm)(seed if seed is not None else DEFAULT_NONE_HASH_SEED)


def block_extra_keys(
    start_token: int, lora: tuple[str, str] | None = None, cache_salt: str | None = None
) -> tuple[Any, ...] | None:
    """Extra keys of the block starting at ``start_token``; ``lora`` is (name, path)."""
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt and start_token == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def hash_block_tokens(
    algorithm: str,
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    root: bytes | None = None,
) -> bytes:
    """One block's digest. A falsy parent means the chain's root (``root`` or NONE_HASH)."""
    if not parent:
        parent = root if root is not None else none_hash(algorithm)
    return hash_function(algorithm)((parent, tuple(token_ids), extra_keys))


def prompt_block_hashes(  # noqa: PLR0913 - vLLM's block hash inputs, as vLLM takes them
    token_ids: Sequence[int],
    block_size: int,
    algorithm: str = "sha256",
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    seed: str | None = None,
) -> list[bytes]:
    """Digests of every full ``block_size`` window of a prompt, chained from NONE_HASH."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    root = none_hash(algorithm, seed)
    fn = hash_function(algorithm)
    hashes: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = block_extra_keys(start, lora, cache_salt)
        parent = fn((parent, tuple(token_ids[start : start + block_size]), extra))
        hashes.append(parent)
    return hashes


def to_int64_bytes(digest: bytes) -> bytes:
    """vLLM's int64 wire form of a digest, as 8 big-endian bytes (its last 8 bytes)."""
    return bytes(digest[-8:])


def int_to_hash_bytes(value: int) -> bytes:
    """A hash published as an int (vLLM's default) as 8 big-endian bytes."""
    return (value & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
