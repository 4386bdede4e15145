"""What a batch touches (consumer.core.needs): the keys a store loads for it."""

from __future__ import annotations

from kvledger.consumer.core.model import GroupKey, HolderKey, HolderScope, Needs, SourceKey
from kvledger.consumer.core.needs import needs
from kvledger.consumer.inbound import Decoded, decode
from kvledger.schemas.events import EventsLost, Goodbye
from tests.helpers.streams import MODEL, Stream, cleared, h, removed, spec, stored

A, B = "engine-a", "engine-b"


def batch() -> list[Decoded]:
    s = Stream()
    s.send(A, spec(0))
    s.send(A, stored([1, 2]))
    s.send(A, stored([3], start=None, parent=2, medium="GPU"))  # its position follows 2
    s.send(B, removed([1], ownership="shared"))
    s.send(B, stored([4], group=1), epoch=5)
    s.send(A, cleared("CPU", group=0))
    s.send(B, EventsLost(7, 9, group_idx=1), epoch=5)
    s.send(B, Goodbye(group_idx=0))
    s.raw(b"not avro")
    return [decode(m, s.codec) for m in s.messages]


def test_the_keys_a_batch_touches() -> None:
    got = needs(batch())
    assert got.blocks == {GroupKey(MODEL, 0): {h(1), h(2), h(3)}, GroupKey(MODEL, 1): {h(4)}}
    assert got.residencies == {
        HolderKey(MODEL, 0, A, "CPU", ""): {h(1), h(2)},
        HolderKey(MODEL, 0, A, "GPU", ""): {h(3)},
        HolderKey(MODEL, 0, B, "CPU", "shared"): {h(1)},
        HolderKey(MODEL, 1, B, "CPU", ""): {h(4)},
    }
    assert got.scopes == {
        HolderScope(MODEL, 0, A, "CPU", None),
        HolderScope(MODEL, 1, B, None, None),
        HolderScope(MODEL, None, B, None, None),
    }
    assert got.restarts == {
        SourceKey(A, MODEL, 0): 1, SourceKey(B, MODEL, 0): 1, SourceKey(B, MODEL, 1): 5,
    }  # fmt: skip
    assert got.sources == {A, B}
    assert got.replayed == []


def test_the_parent_is_wanted_only_when_the_position_is_unknown() -> None:
    s = Stream()
    s.send(A, stored([5], start=8, parent=4))
    assert needs([decode(m, s.codec) for m in s.messages]).blocks == {GroupKey(MODEL, 0): {h(5)}}


def test_a_replay_names_its_stores_and_no_stream() -> None:
    decoded = batch()
    got = needs(decoded, check_sequence=False)
    stores = [d.message for d in decoded[1:3]] + [decoded[4].message]
    assert got.replayed == [
        (HolderKey(MODEL, 0, A, "CPU", ""), m.topic, m.partition, m.offset) if i == 0
        else (HolderKey(MODEL, 0, A, "GPU", ""), m.topic, m.partition, m.offset) if i == 1
        else (HolderKey(MODEL, 1, B, "CPU", ""), m.topic, m.partition, m.offset)
        for i, m in enumerate(stores)
    ]  # fmt: skip
    assert not got.restarts and not got.sources
    assert got.blocks and got.residencies  # keys still wanted by a store that loads them


def test_an_in_process_store_gets_only_the_replays_stores() -> None:
    decoded = batch()
    assert needs(decoded, keys=False) == Needs()
    full = needs(decoded, check_sequence=False)
    assert needs(decoded, check_sequence=False, keys=False) == Needs(replayed=full.replayed)
