"""kvledger's block hashing against vLLM 0.33.0's own hash functions (its
vllm/utils/hashing.py, run from the released wheel), for every algorithm an engine can be
configured with."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from kvledger.schemas.hashing import ALGORITHMS, hash_block_tokens, none_hash
from tests.helpers.vllm_wheel import vllm_module

pytestmark = pytest.mark.integration  # it needs the vLLM wheel from the package registry


@pytest.fixture(scope="module")
def vllm_hashing() -> Iterator[ModuleType]:
    with vllm_module("vllm.utils.hashing") as module:
        yield module


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_hashes_as_vllm_does(vllm_hashing: ModuleType, algorithm: str) -> None:
    theirs = vllm_hashing.get_hash_fn_by_name(algorithm)
    root = theirs("1234")  # NONE_HASH with PYTHONHASHSEED=1234
    assert none_hash(algorithm, seed="1234") == root
    parent = root
    extra: tuple[object, ...] | None = (("lora", "sql", "/a"), ("cache_salt", "s"))
    for tokens in ([1, 2, 3, 4], [5, 6, 7, 8], list(range(60_000, 60_016))):
        want = theirs((parent, tuple(tokens), extra))
        assert hash_block_tokens(algorithm, parent, tokens, extra, root=root) == want
        parent, extra = want, None
    assert len(parent) == (16 if algorithm.startswith("xxhash") else 32)


@pytest.mark.parametrize("algorithm", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_a_seed_is_refused(algorithm: str) -> None:
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        none_hash(algorithm)
