"""The compiled pass from vLLM's events to Avro (producer/_vllm.c) against the Python path it
stands in for: the vLLM adapter's mapping, the fit to the group's spec, the hash form, the
envelope and the codec. Same bytes for every event it takes; the events it leaves to the
Python path get that path's answer, bytes or refusal."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgspec
import pytest

from kvledger.producer.prepared import COMPILED, NotCompiledError, Prepared, WireForm
from kvledger.producer.relay.wire import (
    _Removed,
    _Stored,
    _StoredArray,
    decode_batch,
    read_batch,
)
from kvledger.producer.vllm import (
    EXTENSIONS,
    FIELDS,
    REQUIRED,
    VllmEventError,
    fit_to_spec,
    from_vllm_event,
)
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import Envelope, GroupSpec, KVEvent, group_of
from tests.helpers.vllm_wheel import vllm_module

pytestmark = pytest.mark.skipif(
    not COMPILED and os.environ.get("CI") != "true",
    reason="the C extension was not built (no compiler); CI requires it",
)

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
    """vLLM's event classes with a slot per field, as msgspec structs keep theirs (the
    compiled pass reads those at their offsets): ``names``, else every field and extension.
    A field left unset is an absent attribute."""
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


def compiled_path(item: Prepared, form: WireForm, seq: int, engine_seq: int | None) -> bytes:
    head = CODEC.envelope_head(STAMP["source"], STAMP["model"], STAMP["dp_rank"], STAMP["epoch"])
    return form.frame(head, seq, 1_764_000_000_999, item[2], engine_seq)


def test_ci_builds_the_compiled_pass() -> None:
    assert COMPILED, "CI must build producer/_vllm.c (is a C compiler there?)"
    assert WireForm(False, compiled=True).compiled


def taken(item: object) -> bool:
    """Prepared by the compiled pass (a tuple: kind, group, bytes)."""
    return type(item) is tuple


def _form(digest: bool, codec: Codec | None = None) -> WireForm:
    form = WireForm(digest, compiled=True, codec=codec)
    for spec in SPECS:
        form.announce(spec)
    return form


@pytest.mark.parametrize("digest", [False, True])
@pytest.mark.parametrize("with_codec", [False, True])
@pytest.mark.parametrize("in_slots", [False, True])
def test_the_compiled_pass_writes_the_python_paths_bytes(
    digest: bool, with_codec: bool, in_slots: bool
) -> None:
    """Without a codec, what the pass leaves stays a kvledger event; with one (as a
    publisher has it), a store or removal is written to its branch's bytes as it is mapped.
    Fields in an instance dict are read by name, fields in slots at their offsets."""
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
            assert compiled_path(item, form, i, engine_seq) == want, fields_of(event)
        else:  # left to the mapping: only a block's extra keys or an extension value
            assert not with_codec
            assert CODEC.encode(_envelope(item, i, engine_seq)) == want
    assert count >= (600 if with_codec else 500)  # the common shapes are all taken


def test_partial_tails_are_marked_from_the_spec() -> None:
    form = _form(False)
    tail = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[1] * 16,
                       block_size=16, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=None, group_idx=1, kv_cache_spec_kind=None,
                       kv_cache_spec_sliding_window=None, locality=None, ownership=None,
                       session_id=None, lookahead_token_ids=None)  # fmt: skip
    [item] = form.prepare([tail])
    assert taken(item)
    decoded = CODEC.decode(compiled_path(item, form, 0, None)).event
    assert decoded.partial and decoded.block_size == 16  # type: ignore[union-attr]
    tail.group_idx = 0  # a group that hashes at its block size: a whole block
    [item] = form.prepare([tail])
    assert not CODEC.decode(compiled_path(item, form, 0, None)).event.partial  # type: ignore[union-attr]


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
    with pytest.raises((VllmEventError, ValueError, TypeError)) as compiled_error:
        [item] = form.prepare([_store(**changes)])
        CODEC.encode(_envelope(item, 0, None)) if not taken(item) else None
        raise AssertionError(f"taken: {item!r}")
    with pytest.raises(type(compiled_error.value)) as python_error:
        python_path(_store(**changes), form, 0, None)
    assert str(python_error.value) == str(compiled_error.value)


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
def test_what_the_compiled_pass_leaves_gets_the_python_paths_bytes(
    changes: dict[str, Any],
) -> None:
    form = _form(False)
    [item] = form.prepare([_store(**changes)])
    got = compiled_path(item, form, 7, 9) if taken(item) else CODEC.encode(_envelope(item, 7, 9))
    assert got == python_path(_store(**changes), form, 7, 9)


@pytest.mark.parametrize(
    "changes",
    [{"block_size": 2**40}, {"token_ids": [2**40]}, {"lookahead_token_ids": [[2**63]]}],
)
def test_an_int_the_contract_cannot_carry_refuses_its_batch_before_any_is_produced(
    changes: dict[str, Any],
) -> None:
    form = WireForm(False, compiled=True, codec=CODEC)
    with pytest.raises(VllmEventError, match="out of range for an Avro"):
        form.prepare([_store(), _store(**changes)])


def test_absent_fields_take_their_defaults_and_a_missing_required_one_is_named() -> None:
    # An older engine's store (no lora_id, medium, lora_name) and fields left at defaults.
    old = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    removal = BlockRemoved(block_hashes=[1], medium=None)
    form = _form(False)
    for event in (old, removal):
        [item] = form.prepare([event])
        assert taken(item)
        assert compiled_path(item, form, 0, None) == python_path(event, form, 0, None)
    for event in (BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2]),
                  BlockRemoved(block_hashes=[1])):  # fmt: skip
        with pytest.raises(VllmEventError, match=r"lacks (block_size|medium)"):
            form.prepare([event])


def test_a_class_changed_after_its_events_were_read_is_read_as_it_now_is() -> None:
    """The pass keeps where a class holds each field; a change to the class (a property over
    a slot, a class attribute where its objects had nothing) is seen at once."""
    cls = slotted_classes(*FIELDS["BlockStored"][:7])["BlockStored"]  # no slot past lora_name
    event = cls(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
    form = _form(False)

    def read() -> Any:
        items = form.prepare([event, event])  # the first read after a change is by name
        assert all(taken(item) for item in items) and items[0] == items[1]
        assert compiled_path(items[1], form, 0, None) == python_path(event, form, 0, None)
        return CODEC.decode(compiled_path(items[1], form, 0, None)).event

    assert (read().medium, read().session_id) == ("GPU", None)
    cls.medium = property(lambda self: "CPU")  # type: ignore[attr-defined]
    assert read().medium == "CPU"
    cls.session_id = "s-1"  # type: ignore[attr-defined]
    assert read().session_id == "s-1"
    del cls.session_id  # type: ignore[attr-defined]
    assert read().session_id is None
    sub = type("BlockStored", (cls,), {"__getattr__": lambda self, name: None})
    event = sub(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    assert read().lora_id is None  # read by name: __getattr__ answers for what is unset


def test_the_relays_decoded_structs_take_the_compiled_pass() -> None:
    form = _form(False)
    for struct in (_Stored, _StoredArray):
        event = struct(block_hashes=[1, b"x" * 32], parent_block_hash=3, token_ids=[7] * 32,
                       block_size=16, medium="CPU", group_idx=1)  # fmt: skip
        [item] = form.prepare([event])
        assert taken(item) and item[0] == "BlockStored"
        assert compiled_path(item, form, 1, 2) == python_path(event, form, 1, 2)
    [item] = form.prepare([_Removed(block_hashes=[4], medium="GPU")])
    assert taken(item) and item[0] == "BlockRemoved"


@pytest.fixture
def vllm_kv_events() -> Iterator[ModuleType]:
    with vllm_module("vllm.distributed.kv_events") as module:
        yield module


@pytest.mark.downloads
def test_vllms_own_event_objects_take_the_compiled_pass(vllm_kv_events: ModuleType) -> None:
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
        assert compiled_path(item, form, i, None) == python_path(event, form, i, None)  # type: ignore[arg-type]


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


# ---------------------------------------------------------------------- a relay's packed batches
def _payload(events: list[Any], positional: bool) -> bytes:
    """A batch on vLLM's wire: tagged maps, or positional arrays (vLLM's field order)."""
    encoded = []
    for event in events:
        kind = type(event).__name__
        fields = {  # vLLM sends its fields without defaults, and leaves out those at theirs
            n: v
            for i, n in enumerate(FIELDS[kind])
            if (v := getattr(event, n, None)) is not None or i < REQUIRED[kind]
        }
        if positional:
            last = max((FIELDS[kind].index(n) for n in fields), default=-1)
            encoded.append([kind, *(getattr(event, n, None) for n in FIELDS[kind][: last + 1])])
        else:
            encoded.append({"type": kind, **fields})
    return msgspec.msgpack.encode([1_764_000_000.5, encoded, 0])


def _left_to_the_mapping(event: Any) -> bool:
    """What the packed pass leaves: a pool reset, extra keys, a string beyond ASCII."""
    if type(event).__name__ == "AllBlocksCleared":
        return True
    values = [getattr(event, n, None) for n in FIELDS[type(event).__name__]]
    extra = getattr(event, "extra_keys", None) or []
    return any(k is not None for k in extra) or any(
        isinstance(v, str) and not v.isascii() for v in values
    )


def _prepared_bytes(items: list[Any], form: WireForm) -> list[bytes]:
    return [
        compiled_path(item, form, i, 5) if taken(item) else CODEC.encode(_envelope(item, i, 5))
        for i, item in enumerate(items)
    ]


@pytest.mark.parametrize("positional", [False, True])
def test_packed_batches_take_the_compiled_pass_with_the_same_bytes(positional: bool) -> None:
    form = _form(False)
    events: list[Any] = [e for e in vllm_events(400, seed=11) if not hasattr(e, "partial")]
    events[7:7] = [AllBlocksCleared()]  # vLLM's pool reset, among them
    packed = 0
    for start in range(0, len(events), 4):
        payload = _payload(events[start : start + 4], positional)
        want = _prepared_bytes(form.prepare(decode_batch(payload).events), form)
        batch = read_batch(payload, packed=True)
        assert batch.packed
        try:
            items = form.prepare(batch.events, packed=True)
        except NotCompiledError:  # the relay decodes such a batch whole
            assert any(_left_to_the_mapping(e) for e in events[start : start + 4])
            continue
        assert all(taken(item) for item in items)
        assert _prepared_bytes(items, form) == want
        packed += 1
    assert packed >= 25  # of 100 batches


@pytest.mark.parametrize(
    "hashes, tokens",
    [
        ([-1], [1]),  # a negative hash
        ([1], [2**31]),  # a token id beyond the contract's int
        ([1], [1.5]),  # not an int
        (["x"], [1]),
    ],
)
def test_a_packed_batch_the_compiled_pass_declines_is_decoded_whole(
    hashes: list[Any], tokens: list[Any]
) -> None:
    form = _form(False)
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": tokens, "block_size": 1}]]
    )  # fmt: skip
    try:
        batch = read_batch(payload, packed=True)
    except VllmEventError:
        pytest.fail("a batch of the right shape is read")
    if batch.packed:
        with pytest.raises(NotCompiledError):
            form.prepare(batch.events, packed=True)
    with pytest.raises((VllmEventError, ValueError)):  # whole, the mapping refuses it
        items = form.prepare(read_batch(payload).events)
        CODEC.encode(_envelope(items[0], 0, None))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "event, taken_here",
    [
        ({"session_id": "s" * 40, "lora_name": "x" * 300}, True),  # str 8 and str 16
        ({"token_ids": [0, 127, -1, -32, -33, 128, 255, 256, 65535, 65536, -(2**31)]}, True),
        ({"block_hashes": [2**63, 2**64 - 1, 0, b"\x01" * 40]}, True),
        ({"extra_keys": [None, None]}, True),
        ({"somebody_elses_field": 1}, False),  # msgspec ignores it; the mapping decides
        ({"token_ids": [1, True]}, False),
        ({"block_size": 1.0}, False),
        ({"medium": "GPU\u00e9"}, False),  # beyond ASCII: msgspec checks the UTF-8
    ],
)
def test_packed_event_edges(event: dict[str, Any], taken_here: bool) -> None:
    fields = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 5,
              "token_ids": [1, 2, 3, 4], "block_size": 2, **event}  # fmt: skip
    payload = msgspec.msgpack.encode([1.0, [fields], 3])
    form = _form(False)
    batch = read_batch(payload, packed=True)
    if not taken_here:
        with pytest.raises(NotCompiledError):
            form.prepare(batch.events, packed=True)
        return
    items = form.prepare(batch.events, packed=True)
    assert _prepared_bytes(items, form) == _prepared_bytes(
        form.prepare(decode_batch(payload).events), form
    )


def test_a_list_prepared_whole_matches_one_by_one() -> None:
    """The compiled pass over a whole list (classes seen before, and one it has not seen,
    and kvledger's own events among them) gives each event's own answer."""
    form = _form(False)
    events: list[Any] = list(vllm_events(60, seed=21))

    class Fresh(BlockStored):  # a class the pass has not seen: left, then learnt
        pass

    Fresh.__name__ = "BlockStored"
    events[5] = Fresh(**vars(events[0]))
    events[9] = from_vllm_event(events[1])  # already kvledger's
    whole = form.prepare(events)
    one_by_one = [form.prepare([e])[0] for e in events]
    assert whole == one_by_one
    with pytest.raises(TypeError, match="not a vLLM KV cache event"):
        form.prepare([events[0], (1, 2)])  # a tuple is no event (nor taken for a prepared one)


def _recorder(fail_at: int | None = None) -> tuple[list[tuple[str, bytes, bytes]], Any]:
    """A produce function that records (topic, value, key); the call numbered ``fail_at``
    raises, as the Kafka client does for a message it refuses."""
    calls: list[tuple[str, bytes, bytes]] = []

    def produce(topic: str, value: bytes, key: bytes) -> None:
        if len(calls) == fail_at:
            raise BufferError("queue full")
        calls.append((topic, value, key))

    return calls, produce


def test_a_batch_published_in_one_call_is_what_prepare_then_produce_give() -> None:
    """publish (prepare and produce in one call, an embedded engine's batch) produces the
    same messages, numbers and counts as prepare then produce; a batch with an event the
    pass leaves produces nothing; a refused produce stops it where produce stops, and
    what was not produced comes back as prepare gives it."""
    form = _form(False)
    head = CODEC.envelope_head(STAMP["source"], "m", 2, STAMP["epoch"])
    events = [e for e in vllm_events(200, seed=5) if taken(form.prepare([e])[0])]
    keys = {g: f"engine/{g}".encode() for g in (0, 1, 3, 7)}
    assert len(events) > 50

    want_calls, produce = _recorder()
    want_seqs: dict[int, int] = {3: 40}
    want_counts: dict[str, int] = {}
    from kvledger.producer import _vllm

    done = _vllm.produce(produce, "t", head, 1_764_000_000_500, 9, form.prepare(events), 0,
                         want_seqs, keys, want_counts)  # fmt: skip
    assert done == len(events)

    calls, produce = _recorder()
    seqs: dict[int, int] = {3: 40}
    counts: dict[str, int] = {}
    got = form.publish(events, produce, "t", head, 1_764_000_000_500, 9, seqs, keys, counts)
    assert got == ([], len(events))  # nothing left: every one produced
    assert (calls, seqs, counts) == (want_calls, want_seqs, want_counts)

    class Unseen(BlockStored):  # a class the pass has not learnt: the batch goes back
        pass

    calls, produce = _recorder()
    seqs = {}
    left = [*events[:5], Unseen(**vars(events[0]))]
    assert form.publish(left, produce, "t", head, 1, None, seqs, keys, {}) is None
    assert calls == [] and seqs == {}

    calls, produce = _recorder(fail_at=7)
    seqs = {3: 40}
    got = form.publish(events, produce, "t", head, 1_764_000_000_500, 9, seqs, keys, {})
    assert got == (form.prepare(events)[7:], 7)  # the rest, as prepare gives it
    assert calls == want_calls[:7]
    numbered = [group_of(from_vllm_event(e)) for e in events[:7]]
    assert all(seqs[g] == (40 if g == 3 else 0) + numbered.count(g) for g in set(numbered))


@pytest.mark.parametrize("positional", [False, True])
def test_a_packed_batch_published_in_one_call_is_what_prepare_then_produce_give(
    positional: bool,
) -> None:
    """publish_packed (a relay's batch, events still msgpack) produces what the packed
    prepare then produce do, or nothing where the pass declines one of its events."""
    from kvledger.producer import _vllm

    form = _form(False)
    head = CODEC.envelope_head(STAMP["source"], "m", 0, STAMP["epoch"])
    keys = {g: f"engine/{g}".encode() for g in (0, 1, 3, 7)}
    events: list[Any] = [e for e in vllm_events(400, seed=11) if not hasattr(e, "partial")]
    published = declined = 0
    for start in range(0, len(events), 4):
        batch = read_batch(_payload(events[start : start + 4], positional), packed=True)
        calls, produce = _recorder()
        seqs: dict[int, int] = {0: 3}
        got = form.publish_packed(batch.events, produce, "t", head, 77, start, seqs, keys, {})
        try:
            items = form.prepare(batch.events, packed=True)
        except NotCompiledError:
            assert got is None and calls == [] and seqs == {0: 3}
            declined += 1
            continue
        want_calls, want_produce = _recorder()
        want_seqs: dict[int, int] = {0: 3}
        _vllm.produce(want_produce, "t", head, 77, start, items, 0, want_seqs, keys, {})
        assert got == ([], len(items))
        assert (calls, seqs) == (want_calls, want_seqs)
        if len(items) > 1:  # refused at the second: the rest comes back as prepared
            calls, produce = _recorder(fail_at=1)
            got = form.publish_packed(batch.events, produce, "t", head, 77, start, {0: 3}, keys, {})
            assert got == (items[1:], 1) and calls == want_calls[:1]
        published += 1
    assert published >= 25 and declined >= 1


@pytest.mark.parametrize("lists", [20_000, 1, 0])
def test_more_lookahead_lists_than_hashes_never_outgrow_the_writer(lists: int) -> None:
    """Each empty list's end byte is written with room for it: 20,000 empty lookahead lists
    under one hash overflowed the writer once (a heap overflow that aborted the relay, and
    again after every restart, since the engine replays the batch). Whatever the pass
    does with such an event, the Python path's answer is the same."""
    fields = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2,
              "lookahead_token_ids": [[]] * lists}  # fmt: skip
    payload = msgspec.msgpack.encode([1.0, [fields], 0])
    form = _form(False)

    def python_answer() -> object:
        try:
            return _prepared_bytes(form.prepare(decode_batch(payload).events), form)
        except (VllmEventError, ValueError) as exc:
            return type(exc)

    want = python_answer()
    for packed in (True, False):  # the relay's msgpack, and decoded objects
        events = read_batch(payload, packed=True).events if packed else decode_batch(payload).events
        try:
            got: object = _prepared_bytes(form.prepare(events, packed=packed), form)
        except NotCompiledError:
            continue  # left to the Python path, whose answer is want
        except (VllmEventError, ValueError) as exc:
            got = type(exc)
        assert got == want, packed


def test_a_slot_borrowed_from_another_class_is_not_read_at_its_offset() -> None:
    """A class whose attribute is another class's slot descriptor: that offset is into the
    other class's objects (here past the end of this one's), so the pass must not read
    there; the event is read by name, and gets the Python path's answer."""
    big = type("Big", (), {"__slots__": tuple(f"s{i}" for i in range(40))})
    small = type("BlockRemoved", (), {"__slots__": ("block_hashes",)})
    small.medium = big.__dict__["s39"]  # type: ignore[attr-defined]
    event = small()
    event.block_hashes = [1]
    form = _form(False)
    try:
        want: object = python_path(event, form, 0, None)
    except Exception as exc:
        want = type(exc)
    try:
        items = form.prepare([event])
        got: object = compiled_path(items[0], form, 0, None) if taken(items[0]) else (
            python_path(items[0], form, 0, None)
        )  # fmt: skip
    except Exception as exc:
        got = type(exc)
    assert got == want
