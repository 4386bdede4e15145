"""SGLang's batches read by `kvledger relay --engine sglang` (producer/relay/sglang.py):
payloads encoded by SGLang 0.5.23's own event classes (from its wheel) become kvledger's
events — signed hashes as their 8 bytes, media mapped, salts and adapters carried — and
what is not SGLang's shape is refused with the reason (the relay records the batch lost)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import msgspec
import pytest

from kvledger.producer.relay import sglang
from kvledger.producer.vllm import VllmEventError
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.helpers.sglang_wheel import sglang_kv_events


@pytest.fixture(scope="module")
def kv() -> Iterator[ModuleType]:
    with sglang_kv_events() as module:
        yield module


def encoded(kv: ModuleType, *events: object, rank: int | None = 0) -> bytes:
    batch = kv.KVEventBatch(ts=12.5, events=list(events), attn_dp_rank=rank)
    return bytes(msgspec.msgpack.Encoder().encode(batch))  # as SGLang's publisher thread


@pytest.mark.downloads
def test_sglangs_own_events_read_as_kvledgers(kv: ModuleType) -> None:
    payload = encoded(
        kv,
        kv.BlockStored(block_hashes=[-5789073693455906733, 7], parent_block_hash=-1,
                       token_ids=list(range(8)), block_size=4, lora_id=3,
                       medium=kv.StorageMedium.CPU.value, cache_salt="tenant-7",
                       session_id="s-1", lora_name="adapter"),
        kv.BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                       block_size=4, lora_id=None),
        kv.BlockRemoved(block_hashes=[-5789073693455906733], medium="EXTERNAL"),
        kv.BlockRemoved(block_hashes=[9], medium="DISK"),
        kv.AllBlocksCleared(),
    )  # fmt: skip
    batch = sglang.read_batch(payload)
    assert (batch.ts, batch.dp_rank) == (12.5, 0)
    salted, plain, external, disk, cleared = batch.events
    assert isinstance(salted, BlockStored) and isinstance(plain, BlockStored)
    assert salted.block_hashes == ((2**64 - 5789073693455906733).to_bytes(8, "big"),
                                   (7).to_bytes(8, "big"))  # fmt: skip
    assert salted.parent_block_hash == b"\xff" * 8  # -1 and 2**64 - 1: one hash
    assert (salted.medium, salted.ownership, salted.lora_name, salted.lora_id) == (
        "CPU", None, "adapter", 3,
    )  # fmt: skip
    assert salted.extra_keys is None and salted.session_id == "s-1"  # under a parent: no salt
    assert (plain.medium, plain.extra_keys, plain.token_ids) == ("GPU", None, (1, 2, 3, 4))
    assert isinstance(external, BlockRemoved) and isinstance(disk, BlockRemoved)
    assert (external.medium, external.ownership) == ("STORAGE", "external")
    assert (disk.medium, disk.ownership) == ("STORAGE", None)
    assert isinstance(cleared, AllBlocksCleared) and cleared.medium == "GPU"


@pytest.mark.downloads
def test_every_sglang_medium_is_mapped(kv: ModuleType) -> None:
    assert {m.value for m in kv.StorageMedium} == {m for m in sglang.MEDIA if m}


@pytest.mark.downloads
def test_what_is_not_sglangs_shape_is_refused_with_its_reason(kv: ModuleType) -> None:
    unknown = encoded(kv, kv.BlockRemoved(block_hashes=[1], medium="NVME"))
    with pytest.raises(VllmEventError, match="unknown SGLang medium 'NVME'"):
        sglang.read_batch(unknown)
    with pytest.raises(VllmEventError, match="not an SGLang KV event batch"):
        sglang.read_batch(b"\x93not msgpack")
    text = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["a"]}]])
    with pytest.raises(VllmEventError, match="not an SGLang"):
        sglang.read_batch(text)
    vllm_only = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])
    with pytest.raises(VllmEventError, match="not an SGLang"):
        sglang.read_batch(vllm_only)


@pytest.mark.downloads
def test_a_salted_requests_first_block_carries_its_salt(kv: ModuleType) -> None:
    """As vLLM sends a salted request's: the salt is the first block's one extra key (the
    token walk of that salt starts there); the blocks after it are reached through it."""
    payload = encoded(
        kv,
        kv.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)),
                       block_size=4, lora_id=None, cache_salt="tenant-7"),
    )  # fmt: skip
    (first,) = sglang.read_batch(payload).events
    assert isinstance(first, BlockStored) and first.extra_keys == ('["tenant-7"]', None)
