"""Block hashing against digests computed with vLLM 0.33.0's own hashing functions.

The expected hex values were computed once by running vLLM 0.33.0's vllm/utils/hashing.py
(sha256, sha256_cbor) on the same tuples vLLM's hash_block_tokens builds:
(parent or NONE_HASH, tuple(tokens), extra_keys), with NONE_HASH = H("vllm-none-hash").
"""

from __future__ import annotations

import pytest

from kvledger.schemas.events import BlockRemoved, BlockStored, with_int64_hashes
from kvledger.schemas.hashing import (
    block_extra_keys,
    hash_block_tokens,
    int_to_hash_bytes,
    none_hash,
    prompt_block_hashes,
    to_int64_bytes,
)

VLLM = {
    "sha256": {
        "none": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "b0": "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
        "b1": "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde",
        "lora0": "31ea413fd23199bedad7ea07fb2f58b2b773dc0f02263fcc2eb8e365f8a43607",
        "lora1": "8528c89b677050fec83cfb431d8a81064fe19dbed3060aa9edd3c68a54938f4f",
        "seed42": "c0bc02c9fc92a4944335649961b9e55cc41b194bece4801e8c6ef0f0f3f5884a",
    },
    "sha256_cbor": {
        "none": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "b0": "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
        "b1": "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
        "lora0": "cf16888835147fd971bff56367df748bcb29d5de666be3d79ae3b88c088b446a",
        "lora1": "0db981310eaca001f1f1a9720052290ca2ced1efc355696a8a6b34a97846529a",
        "seed42": "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780",
    },
}
LORA = ("sql", "/adapters/sql")


@pytest.mark.parametrize("algorithm", sorted(VLLM))
def test_none_hash_and_chain(algorithm: str) -> None:
    want = VLLM[algorithm]
    assert none_hash(algorithm).hex() == want["none"]
    assert none_hash(algorithm, seed="42").hex() == want["seed42"]
    b0 = hash_block_tokens(algorithm, None, [1, 2, 3, 4])
    assert b0.hex() == want["b0"]
    assert hash_block_tokens(algorithm, b0, [5, 6, 7, 8]).hex() == want["b1"]
    assert [h.hex() for h in prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, algorithm)] == [
        want["b0"],
        want["b1"],
    ]


@pytest.mark.parametrize("algorithm", sorted(VLLM))
def test_lora_and_cache_salt_extra_keys(algorithm: str) -> None:
    want = VLLM[algorithm]
    assert block_extra_keys(0, LORA, "s1") == (("lora", *LORA), ("cache_salt", "s1"))
    assert block_extra_keys(4, LORA, "s1") == (("lora", *LORA),)  # salt on block 0 only
    assert block_extra_keys(4) is None
    hashes = prompt_block_hashes(list(range(1, 9)), 4, algorithm, lora=LORA, cache_salt="s1")
    assert [h.hex() for h in hashes] == [want["lora0"], want["lora1"]]


def test_int64_wire_form() -> None:
    digest = bytes.fromhex(VLLM["sha256"]["b0"])
    # vLLM publishes int.from_bytes(digest[-8:], "big"): the last 8 bytes, big-endian.
    as_int = int.from_bytes(digest[-8:], "big")
    assert to_int64_bytes(digest) == int_to_hash_bytes(as_int) == digest[-8:]
    assert int_to_hash_bytes(2**64 - 1) == b"\xff" * 8


def test_events_in_int64_form_keep_every_other_field() -> None:
    digest = bytes.fromhex(VLLM["sha256"]["b0"])
    parent = bytes.fromhex(VLLM["sha256"]["none"])
    stored = BlockStored(
        (digest,), parent, (1, 2, 3, 4), 4, 7, "CPU", "ad", ('["x"]',), 1, "mamba", None,
        "remote", "shared", 8, True, "session-9", ((5, 6),),
    )  # fmt: skip
    wire = with_int64_hashes(stored)
    assert isinstance(wire, BlockStored)
    assert wire.block_hashes == (digest[-8:],) and wire.parent_block_hash == parent[-8:]
    for name in BlockStored.__dataclass_fields__:
        if name not in ("block_hashes", "parent_block_hash"):
            assert getattr(wire, name) == getattr(stored, name), name
    removed = BlockRemoved((digest, digest[-8:]), "GPU", 2, "local", "primary")
    assert with_int64_hashes(removed) == BlockRemoved(
        (digest[-8:],) * 2, "GPU", 2, "local", "primary"
    )
    assert with_int64_hashes(wire) is wire  # already in the wire form


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="unsupported hash algorithm"):
        none_hash("md5")
