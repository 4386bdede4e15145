"""kvledger's reading of Dynamo's block hashing (schemas/dynamo.py) against Dynamo's own
(``compute_block_hash_for_seq`` from the ai-dynamo-runtime 1.6.1 wheel): every block a
simulated fleet stores, without and with LoRA adapters and cache namespaces, hashed alike."""

from __future__ import annotations

import os

import pytest

from kvledger.fleet import FleetConfig
from kvledger.schemas.dynamo import dynamo_block_hashes
from kvledger.schemas.events import BlockStored
from tests.helpers.streams import fleet_stream

if os.environ.get("CI") == "true":  # CI installs the dev extra: no skipping there
    import dynamo._core as dynamo
else:
    dynamo = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime (the dev extra)")


def _stored_blocks() -> list[tuple[tuple[int, ...], int]]:
    from kvledger.schemas.codec import Codec

    codec = Codec()
    out = []
    for message in fleet_stream(FleetConfig(instances=2, requests=12, seed=6)).messages:
        event = codec.decode(message.value).event
        if isinstance(event, BlockStored) and event.block_size > 0:
            out.append((event.token_ids, event.block_size))
    return out


@pytest.mark.parametrize(
    "lora, namespace",
    [
        (None, None),
        ("adapter-a", None),
        (None, "tenant-7"),
        ("adapter-\u00e9", "tenant-7"),
        ("", ""),
    ],
)
def test_every_stored_block_hashes_as_dynamo_hashes_it(
    lora: str | None, namespace: str | None
) -> None:
    blocks = _stored_blocks()
    assert len(blocks) > 50
    for tokens, size in blocks:
        want = dynamo.compute_block_hash_for_seq(
            list(tokens), size, lora_name=lora, cache_namespace=namespace
        )
        assert dynamo_block_hashes(tokens, size, lora, namespace) == want


def test_partial_blocks_and_edges() -> None:
    tokens = list(range(1, 10))  # two full blocks of 4 and a partial one
    assert dynamo_block_hashes(tokens, 4) == dynamo.compute_block_hash_for_seq(tokens, 4)
    assert dynamo_block_hashes(tokens, 4) == [14643705804678351452, 16777012769546811212]
    assert dynamo_block_hashes([1, 2, 3], 4) == [] and dynamo_block_hashes(tokens, 0) == []
    big = [2**32 - 1, 0, 2**31, 7]  # unsigned 32-bit ids, as Dynamo reads them
    assert dynamo_block_hashes(big, 2) == dynamo.compute_block_hash_for_seq(big, 2)


@pytest.mark.parametrize("block_size", [2**62, 2**62 + 1, 2**63 - 1, -1, 0])
def test_a_block_size_no_prompt_can_fill_gives_no_hashes(block_size: int) -> None:
    """The core's packed hashing took a caller's block size times 4: 2**62 panicked, and
    2**62 + 1 wrapped to a wrong count of hashes."""
    try:
        from kvledger import _core
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("the compiled core was not built (no Rust toolchain); CI requires it")
    packed = bytes(range(64))  # 16 token ids
    assert _core.dynamo_packed_hashes(packed, block_size, 0) == []
    assert len(_core.dynamo_packed_hashes(packed, 4, 0)) == 4
