"""vLLM's events through the producer's wire form (producer/prepared.py): the vLLM adapter's
mapping, the fit to the group's spec, the hash form, and a store or removal written once as
its event branch's bytes and framed when numbered. The framed message is byte for byte the
envelope the codec encodes whole; what the mapping refuses refuses its batch."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgspec
import pytest

from kvledger.producer.prepared import Prepared, WireForm, frame, split_store
from kvledger.producer.relay.wire import _Removed, _Stored, _StoredArray, decode_batch
from kvledger.producer.vllm import (
    EXTENSIONS,
    FIELDS,
    VllmEventError,
    fit_to_spec,
    from_vllm_event,
    from_vllm_fields,
)
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import Envelope, GroupSpec, KVEvent, group_of
from tests.helpers.vllm_wheel import vllm_module

CODEC = Codec()
SPECS = [
    GroupSpec("m", 0, "full_attention", 16, 16),
    GroupSpec("m", 1, "mamba", 64, 16),  # a store of 16 here is a partial tail
    GroupSpec("m", 3, "sliding_window", 4, 4, sliding_window=128),
]
STAMP = {"source": "engine-\u00e9", "model": "m", "dp_rank": 2, "epoch": 1_764_000_000_123}


class BlockStored:  # vLLM's class name and attributes, as an embedded engine has them
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class BlockRemoved(BlockStored):
    pass


class AllBlocksCleared(BlockStored):
    pass


def _init(self: object, **fields: Any) -> None:
    for name, value in fields.items():
        setattr(self, name, value)


def slotted_classes(*names: str) -> dict[str, type]:
    """vLLM's event classes with a slot per field, as msgspec structs keep theirs: ``names``,
    else every field and extension. A field left unset is an absent attribute."""
    return {
        kind: type(kind, (), {"__slots__": names or (*FIELDS[kind], *EXTENSIONS),
                              "__init__": _init})
        for kind in ("BlockStored", "BlockRemoved")
    }  # fmt: skip


SLOTTED = slotted_classes()


def slotted(event: Any) -> Any:
    """The same event as an object of its slotted class."""
    return SLOTTED[type(event).__name__](**vars(event))


def fields_of(event: Any) -> dict[str, Any]:
    if hasattr(event, "__dict__"):
        return vars(event)
    return {n: getattr(event, n) for n in type(event).__slots__ if hasattr(event, n)}


def _hash(rng: random.Random) -> object:
    return rng.choice([
        rng.getrandbits(64), 0, 2**64 - 1, rng.randbytes(32), rng.randbytes(8), rng.randbytes(3),
    ])  # fmt: skip


def _maybe(rng: random.Random, value: object) -> object:
    return value if rng.random() < 0.5 else None


def vllm_events(count: int, seed: int = 3) -> Iterator[Any]:
    """vLLM-shaped events over the range of what engines send (and kvledger's extensions)."""
    rng = random.Random(seed)
    for i in range(count):
        n = rng.randrange(0, 5)
        hashes = [_hash(rng) for _ in range(n)]
        group = rng.choice([None, 0, 1, 3, 7])
        if i % 3 == 2:
            yield BlockRemoved(
                block_hashes=hashes, medium=_maybe(rng, rng.choice(["GPU", "CPU"])),
                group_idx=group, locality=_maybe(rng, "LOCAL"), ownership=_maybe(rng, "owned"),
            )  # fmt: skip
            continue
        size = rng.choice([0, 4, 16, 64])
        fields: dict[str, Any] = {
            "block_hashes": hashes, "parent_block_hash": _maybe(rng, _hash(rng)),
            "token_ids": [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(40))],
            "block_size": size, "lora_id": _maybe(rng, rng.randrange(-5, 2**31)),
            "medium": _maybe(rng, "CPU"),
            "lora_name": _maybe(rng, rng.choice(["adapter-1", "adapter-\u4e2d"])),
            "extra_keys": rng.choice([None, [None] * n, []]), "group_idx": group,
            "kv_cache_spec_kind": _maybe(rng, "mamba"),
            "kv_cache_spec_sliding_window": _maybe(rng, 4096),
            "locality": _maybe(rng, "REMOTE"), "ownership": _maybe(rng, "shared"),
            "session_id": _maybe(rng, f"s{i}"),
            "lookahead_token_ids": rng.choice([None, [], [[1, -(2**63)], [2**63 - 1]]]),
        }  # fmt: skip
        if rng.random() < 0.2:  # kvledger's extensions, set by an engine that knows them
            fields.update(token_start=_maybe(rng, rng.randrange(0, 2**40)),
                          partial=rng.choice([True, False, None]))  # fmt: skip
        yield BlockStored(**fields)


def python_path(event: Any, form: WireForm, seq: int, engine_seq: int | None) -> bytes:
    mapped = fit_to_spec(from_vllm_event(event), form.specs.get(group_of(from_vllm_event(event))))
    return CODEC.encode(_envelope(form.hashes(mapped), seq, engine_seq))


def _envelope(event: KVEvent, seq: int, engine_seq: int | None) -> Envelope:
    return Envelope(**STAMP, seq=seq, event_time_ms=1_764_000_000_999, event=event,
                    engine_seq=engine_seq)  # fmt: skip


def framed(item: Prepared, seq: int, engine_seq: int | None) -> bytes:
    head = CODEC.envelope_head(STAMP["source"], STAMP["model"], STAMP["dp_rank"], STAMP["epoch"])
    return frame(head, seq, 1_764_000_000_999, item[2], engine_seq)


def taken(item: object) -> bool:
    """Prepared as its event branch's bytes (a tuple: kind, group, bytes)."""
    return type(item) is tuple


def _form(digest: bool, codec: Codec | None = CODEC) -> WireForm:
    form = WireForm(digest, codec=codec)
    for spec in SPECS:
        form.announce(spec)
    return form


@pytest.mark.parametrize("digest", [False, True])
@pytest.mark.parametrize("with_codec", [False, True])
@pytest.mark.parametrize("in_slots", [False, True])
def test_prepared_events_frame_to_the_envelope_the_codec_writes(
    digest: bool, with_codec: bool, in_slots: bool
) -> None:
    """Without a codec, a prepared event stays a kvledger event; with one (as a publisher
    has it), a store or removal is written to its branch's bytes as it is mapped, and framed
    it is the whole envelope's bytes."""
    form = _form(digest, CODEC if with_codec else None)
    count = 0
    events = vllm_events(600)
    for i, event in enumerate(map(slotted, events) if in_slots else events):
        [item] = form.prepare([event])
        engine_seq = None if i % 2 else i * 1000
        want = python_path(event, form, i, engine_seq)
        if taken(item):
            count += 1
            assert item[:2] == (type(event).__name__, group_of(from_vllm_event(event)))
            assert framed(item, i, engine_seq) == want, fields_of(event)
        else:
            assert not with_codec
            assert CODEC.encode(_envelope(item, i, engine_seq)) == want
    assert count == (600 if with_codec else 0)


def test_partial_tails_are_marked_from_the_spec() -> None:
    form = _form(False)
    tail = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[1] * 16,
                       block_size=16, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=None, group_idx=1, kv_cache_spec_kind=None,
                       kv_cache_spec_sliding_window=None, locality=None, ownership=None,
                       session_id=None, lookahead_token_ids=None)  # fmt: skip
    [item] = form.prepare([tail])
    decoded = CODEC.decode(framed(item, 0, None)).event  # type: ignore[arg-type]
    assert decoded.partial and decoded.block_size == 16  # type: ignore[union-attr]
    tail.group_idx = 0  # a group that hashes at its block size: a whole block
    [item] = form.prepare([tail])
    assert not CODEC.decode(framed(item, 0, None)).event.partial  # type: ignore[arg-type, union-attr]


def _store(**changes: Any) -> BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
        "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
        "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None, "locality": None, "ownership": None,
        "session_id": None, "lookahead_token_ids": None,
    }  # fmt: skip
    fields.update(changes)
    return BlockStored(**fields)


class Text(str):
    pass


@pytest.mark.parametrize(
    "changes",
    [
        {"block_hashes": [-1]},  # not an unsigned 64-bit hash
        {"block_hashes": [2**64]},
        {"block_hashes": [True]},  # a bool is no hash
        {"block_hashes": "ab"},  # not a list
        {"parent_block_hash": -5},
        {"token_ids": [1, True]},  # vLLM's token ids are ints, never bools
        {"token_ids": [2**31]},  # beyond the Avro int the contract has
        {"token_ids": [1.0]},
        {"block_size": True},
        {"block_size": "16"},
        {"lora_id": 2**31},
        {"medium": 5},
        {"group_idx": False},
        {"group_idx": 2**40},
        {"lookahead_token_ids": [[1, "2"]]},
        {"lookahead_token_ids": [[2**63]]},
        {"session_id": "\ud800"},  # a lone surrogate: no UTF-8
    ],
)
def test_what_the_mapping_refuses_is_refused(changes: dict[str, Any]) -> None:
    form = _form(False)
    with pytest.raises(VllmEventError) as prepared_error:
        form.prepare([_store(**changes)])
    # The mapping's own refusal, or the codec's (an int or text the contract cannot carry)
    # in the prepared one's words.
    with pytest.raises((VllmEventError, ValueError, TypeError)) as python_error:
        python_path(_store(**changes), form, 0, None)
    assert str(python_error.value) in str(prepared_error.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"extra_keys": [("lora", 1), None]},  # keys become canonical JSON: the mapping's
        {"medium": Text("GPU")},  # a str subclass
        {"block_hashes": [bytearray(b"12345678")]},
        {"token_ids": (1, 2, 3, 4), "block_hashes": (1, 2)},  # tuples are taken as lists
        {"partial": 1},  # any truth value, as bool() reads it
    ],
)
def test_unusual_fields_frame_as_the_whole_envelope(changes: dict[str, Any]) -> None:
    form = _form(False)
    [item] = form.prepare([_store(**changes)])
    assert framed(item, 7, 9) == python_path(_store(**changes), form, 7, 9)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [{"block_size": 2**40}, {"token_ids": [2**40]}, {"lookahead_token_ids": [[2**63]]}],
)
def test_an_int_the_contract_cannot_carry_refuses_its_batch_before_any_is_produced(
    changes: dict[str, Any],
) -> None:
    form = WireForm(False, codec=CODEC)
    with pytest.raises(VllmEventError, match="out of range for an Avro"):
        form.prepare([_store(), _store(**changes)])


def test_absent_fields_take_their_defaults_and_a_missing_required_one_is_named() -> None:
    # An older engine's store (no lora_id, medium, lora_name) and fields left at defaults.
    old = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    removal = BlockRemoved(block_hashes=[1], medium=None)
    form = _form(False)
    for event in (old, removal):
        [item] = form.prepare([event])
        assert framed(item, 0, None) == python_path(event, form, 0, None)  # type: ignore[arg-type]
    for event in (BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2]),
                  BlockRemoved(block_hashes=[1])):  # fmt: skip
        with pytest.raises(VllmEventError, match=r"lacks (block_size|medium)"):
            form.prepare([event])


def test_the_relays_decoded_structs_frame_as_the_whole_envelope() -> None:
    form = _form(False)
    for struct in (_Stored, _StoredArray):
        event = struct(block_hashes=[1, b"x" * 32], parent_block_hash=3, token_ids=[7] * 32,
                       block_size=16, medium="CPU", group_idx=1)  # fmt: skip
        [item] = form.prepare([event])
        assert taken(item) and item[0] == "BlockStored"  # type: ignore[index]
        assert framed(item, 1, 2) == python_path(event, form, 1, 2)  # type: ignore[arg-type]
    [item] = form.prepare([_Removed(block_hashes=[4], medium="GPU")])
    assert taken(item) and item[0] == "BlockRemoved"  # type: ignore[index]


@pytest.fixture
def vllm_kv_events() -> Iterator[ModuleType]:
    with vllm_module("vllm.distributed.kv_events") as module:
        yield module


@pytest.mark.downloads
def test_vllms_own_event_objects_frame_as_the_whole_envelope(vllm_kv_events: ModuleType) -> None:
    kv = vllm_kv_events
    form = _form(False)
    events = [
        kv.BlockStored(block_hashes=[2**64 - 1, 5], parent_block_hash=None,
                       token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU",
                       lora_name=None),
        kv.BlockStored(block_hashes=[9], parent_block_hash=5, token_ids=list(range(16)),
                       block_size=16, lora_id=None, medium="CPU", lora_name=None,
                       group_idx=1),
        kv.BlockRemoved(block_hashes=[5], medium="GPU"),
    ]  # fmt: skip
    items = form.prepare(events)
    assert all(taken(item) for item in items)
    for i, (item, event) in enumerate(zip(items, events, strict=True)):
        assert framed(item, i, None) == python_path(event, form, i, None)  # type: ignore[arg-type]


@pytest.mark.downloads
def test_the_benchmarks_vllm_objects_are_vllms_own(vllm_kv_events: ModuleType) -> None:
    """kvledger.vllm_engine.vllm_batch (the publish-path benchmark's batches) builds objects
    that vLLM's own classes match field for field, encoding and all."""
    from kvledger.vllm_engine import removed, stored, vllm_batch

    kv = vllm_kv_events
    events = [stored([2**64 - 1, 5], None, list(range(32)), 16, group_idx=1), removed([5])]
    ours = vllm_batch(1_764_000_000.5, events, rank=3)
    theirs = kv.KVEventBatch(
        ts=1_764_000_000.5, data_parallel_rank=3,
        events=[getattr(kv, e.kind)(**e.fields) for e in events],
    )  # fmt: skip
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode(theirs)
    for mine, vllms in zip(ours.events, theirs.events, strict=True):
        assert type(mine).__struct_fields__ == type(vllms).__struct_fields__
        assert type(mine).__struct_config__.tag == type(vllms).__struct_config__.tag


@pytest.mark.parametrize("lists", [20_000, 1, 0])
def test_more_lookahead_lists_than_hashes_are_read_or_refused_whole(lists: int) -> None:
    """20,000 empty lookahead lists under one hash overflowed the compiled writer the
    producer had once (a heap overflow that aborted the relay, and again after every
    restart, since the engine replays the batch). Read and prepared in Python, such a
    batch is framed as the whole envelope, or refused with a reason."""
    fields = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2,
              "lookahead_token_ids": [[]] * lists}  # fmt: skip
    payload = msgspec.msgpack.encode([1.0, [fields], 0])
    form = _form(False)
    events = decode_batch(payload).events
    try:
        [item] = form.prepare(events)
    except VllmEventError as exc:
        assert "lookahead" in str(exc)
        return
    assert framed(item, 0, None) == python_path(events[0], form, 0, None)  # type: ignore[arg-type]


def test_a_number_past_an_avro_long_is_not_framed() -> None:
    form = _form(False)
    [item] = form.prepare([_store()])
    assert framed(item, 2**63 - 1, None) == python_path(_store(), form, 2**63 - 1, None)  # type: ignore[arg-type]
    head = CODEC.envelope_head(STAMP["source"], STAMP["model"], STAMP["dp_rank"], STAMP["epoch"])
    with pytest.raises(ValueError, match="past an Avro long"):
        frame(head, 0, 1, item[2], 2**63)  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "kept"),
    [
        ([["a"], ["a"]], None),  # LoRA alone: plain blocks of adapter "a"
        ([["a", "salt-1"], ["a"]], ('["salt-1"]', None)),  # the salt stays, on the first block
        ([["a", ["mm-1", 0]], None], ('[["mm-1", 0]]', None)),  # multimodal inputs stay
        ([["b"], ["a"]], ('["b"]', None)),  # only the event's own adapter name goes
    ],
)
def test_a_lora_name_is_kept_once_not_in_every_blocks_extra_keys(
    extra: list[Any], kept: tuple[str | None, ...] | None
) -> None:
    """vLLM sends a LoRA request's adapter name first in each block's extra keys and as
    lora_name: kvledger keeps it in lora_name, so a block with nothing else is plain."""
    fields = {
        "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": list(range(32)),
        "block_size": 16, "lora_id": 3, "medium": "GPU", "lora_name": "a", "extra_keys": extra,
    }  # fmt: skip
    event = from_vllm_fields("BlockStored", fields)
    assert event.lora_name == "a" and event.extra_keys == kept
    without = from_vllm_fields("BlockStored", {**fields, "lora_name": None, "lora_id": None})
    assert without.extra_keys is not None and len(without.extra_keys) == 2  # no LoRA: as sent


def test_a_store_larger_than_a_message_leaves_as_chained_stores_that_fit() -> None:
    """A long prompt's store (once refused by the topic, stopping the relay) is split until
    each part fits: the same blocks, tokens and keys, each part's parent the block before
    it, the partial tail and look-ahead on the last part."""
    n = 300
    event = from_vllm_event(_store(
        block_hashes=list(range(1, n + 1)), parent_block_hash=99,
        token_ids=[40_000 + i for i in range(2 * n - 1)], extra_keys=[[f"k{i}"] for i in range(n)],
        lookahead_token_ids=[[1, 2]],
    ))  # fmt: skip
    event = dataclasses.replace(event, token_start=64, partial=True)
    form = WireForm(False, codec=CODEC, max_bytes=1500)
    items = form.prepare([event])
    assert len(items) > 2 and all(taken(i) and len(i[2]) <= 1500 for i in items)  # type: ignore[index]
    parts = split_store(event, 4)
    assert [len(p.block_hashes) for p in parts] == [75] * 4
    assert sum((p.block_hashes for p in parts), ()) == event.block_hashes
    assert sum((p.token_ids for p in parts), ()) == event.token_ids
    assert sum((p.extra_keys or () for p in parts), ()) == event.extra_keys
    assert [p.parent_block_hash for p in parts] == [
        event.parent_block_hash,
        *(p.block_hashes[-1] for p in parts[:-1]),
    ]
    assert [p.token_start for p in parts] == [64, 64 + 150, 64 + 300, 64 + 450]
    assert [(p.partial, p.lookahead_token_ids) for p in parts] == [(False, None)] * 3 + [
        (True, event.lookahead_token_ids)
    ]


def test_a_single_block_larger_than_a_message_refuses_its_batch() -> None:
    form = WireForm(False, codec=CODEC, max_bytes=1500)
    with pytest.raises(VllmEventError, match="larger than a message may be"):
        form.prepare([_store(block_hashes=[1], token_ids=list(range(40_000, 41_000)))])
