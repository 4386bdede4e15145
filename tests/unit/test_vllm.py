"""The vLLM adapter (producer.vllm): vLLM's event objects to kvledger's events."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvledger.producer.vllm import VllmEventError, from_vllm_event
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored


@dataclass
class VllmBlockStored:  # vLLM's names; the fields a stock engine may leave at their defaults
    block_hashes: list[object]
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[object] | None = None
    group_idx: int | None = None


@dataclass
class VllmBlockRemoved:
    block_hashes: list[object]
    medium: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


@dataclass
class VllmAllBlocksCleared:
    extra: list[object] = field(default_factory=list)


VllmBlockStored.__name__ = "BlockStored"
VllmBlockRemoved.__name__ = "BlockRemoved"
VllmAllBlocksCleared.__name__ = "AllBlocksCleared"


def test_int_hashes_take_the_int64_form_and_bytes_stay() -> None:
    ev = from_vllm_event(VllmBlockStored([2**64 - 1, b"\x01" * 32], 7, [1, 2, 3, 4], 2))
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (b"\xff" * 8, b"\x01" * 32)
    assert ev.parent_block_hash == (7).to_bytes(8, "big")
    assert (ev.token_ids, ev.block_size, ev.medium, ev.group_idx) == ((1, 2, 3, 4), 2, "GPU", None)
    assert (ev.token_start, ev.partial, ev.ownership, ev.locality) == (None, False, None, None)


def test_extra_keys_become_canonical_json_per_block() -> None:
    ev = from_vllm_event(
        VllmBlockStored([1, 2], None, [0] * 4, 2, extra_keys=[("lora", b"\x0a", 3), None])
    )
    assert isinstance(ev, BlockStored) and ev.extra_keys == ('["lora", "0a", 3]', None)


def test_removals_and_clears() -> None:
    ev = from_vllm_event(VllmBlockRemoved([5], "CPU", 1, "disk"))
    assert ev == BlockRemoved(((5).to_bytes(8, "big"),), "CPU", 1, None, "disk")
    assert from_vllm_event(VllmAllBlocksCleared()) == AllBlocksCleared(medium="GPU")


def test_anything_else_is_refused() -> None:
    with pytest.raises(TypeError, match="not a vLLM KV cache event"):
        from_vllm_event(object())
    with pytest.raises(VllmEventError, match="int or bytes"):
        from_vllm_event(VllmBlockStored(["x"], None, [1, 2], 2))
    with pytest.raises(VllmEventError, match="unsigned 64-bit"):
        from_vllm_event(VllmBlockStored([2**64], None, [1, 2], 2))


@pytest.mark.parametrize(
    ("hashes", "tokens", "match"),
    [
        ([-1, 2], [1, 2], "unsigned 64-bit"),  # one bad int among good ones
        ([1, 2**64], [1, 2], "unsigned 64-bit"),
        ([1, True], [1, 2], "int or bytes"),
        ([1, 2], [1, True], "expected an int, got bool"),
        ([1, 2], [1, 2.0], "expected an int, got float"),
        ([1, 2], [1, "2"], "expected an int, got str"),
    ],
)
def test_a_bad_item_among_good_ones_is_named(
    hashes: list[object], tokens: list[object], match: str
) -> None:
    """Hashes and token ids are checked all at once when they are plain ints; one that is
    not is still found and named."""
    with pytest.raises(VllmEventError, match=match):
        from_vllm_event(VllmBlockStored(hashes, None, tokens, 1))  # type: ignore[arg-type]


def test_int_subclasses_and_mixed_hashes_are_read_item_by_item() -> None:
    class Token(int):
        pass

    ev = from_vllm_event(VllmBlockStored([1, b"\x02" * 8], None, [Token(5), 6], 2))
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == ((1).to_bytes(8, "big"), b"\x02" * 8)
    assert ev.token_ids == (5, 6)
    assert from_vllm_event(VllmBlockStored([], None, (t for t in (1, 2)), 2)).token_ids == (1, 2)  # type: ignore[arg-type, union-attr]


def test_without_msgspec_token_ids_are_checked_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvledger's base install has no msgspec: token ids are then checked by their types,
    with the same results and the same errors."""
    monkeypatch.setattr("kvledger.producer.vllm._convert", None)
    ev = from_vllm_event(VllmBlockStored([1], None, [5, 6], 2))
    assert isinstance(ev, BlockStored) and ev.token_ids == (5, 6)
    with pytest.raises(VllmEventError, match="expected an int, got bool"):
        from_vllm_event(VllmBlockStored([1], None, [5, True], 2))
    gen = from_vllm_event(VllmBlockStored([1], None, (t for t in (7, 8)), 2))  # type: ignore[arg-type]
    assert isinstance(gen, BlockStored) and gen.token_ids == (7, 8)
