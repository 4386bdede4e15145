"""The relay's pure parts: vLLM's batch encodings, the engine sequence rule, spec fitting."""

from __future__ import annotations

import msgspec
import pytest

from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.engine import offset_endpoint
from kvledger.producer.relay.sequence import EngineSequence, Seen
from kvledger.producer.relay.wire import decode_batch, seq_of
from kvledger.producer.vllm import VllmEventError, fit_to_spec
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, GroupSpec
from kvledger.vllm_engine import cleared, encode_batch, removed, stored

STORED = stored(
    [2**64 - 1, 5], 7, [1, 2, 3, 4], 2, "CPU", group_idx=1, extra_keys=[["lora-a"], None],
    lookahead_token_ids=[[9], [10]], session_id="s1", ownership="disk", locality="LOCAL",
)  # fmt: skip


def test_a_health_url_is_http() -> None:
    for bad in ("127.0.0.1:8000/health", "tcp://127.0.0.1:8000"):
        with pytest.raises(ValueError, match=r"--health-url .*expected http"):
            RelayConfig("tcp://127.0.0.1:5557", "s", "m", "b:9092", health_url=bad)
    RelayConfig("tcp://127.0.0.1:5557", "s", "m", "b:9092", health_url="http://e:8000/health")


@pytest.mark.parametrize("positional", [False, True], ids=["tagged maps", "positional arrays"])
def test_both_encodings_decode_to_the_same_events(positional: bool) -> None:
    payload = encode_batch(12.5, [STORED, removed([5], "CPU", group_idx=1), cleared()], 3,
                           positional)  # fmt: skip
    batch = decode_batch(payload)
    assert (batch.ts, batch.dp_rank) == (12.5, 3)
    first, second, third = batch.events
    assert first == BlockStored(
        block_hashes=(b"\xff" * 8, (5).to_bytes(8, "big")),
        parent_block_hash=(7).to_bytes(8, "big"),
        token_ids=(1, 2, 3, 4), block_size=2, lora_id=None, medium="CPU", lora_name=None,
        extra_keys=('["lora-a"]', None), group_idx=1, locality="LOCAL", ownership="disk",
        session_id="s1", lookahead_token_ids=((9,), (10,)),
    )  # fmt: skip
    assert second == BlockRemoved(((5).to_bytes(8, "big"),), "CPU", 1)
    assert third == AllBlocksCleared(medium="GPU")


def test_fields_left_at_their_defaults_take_them_and_bytes_hashes_stay() -> None:
    event = {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
             "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": None,
             "lora_name": None}  # fmt: skip
    [ev] = decode_batch(msgspec.msgpack.encode([1.0, [event]])).events
    assert isinstance(ev, BlockStored)
    assert (ev.block_hashes, ev.group_idx, ev.medium, ev.token_start) == (
        (b"\x01" * 32,), None, None, None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), "an array"),
        (msgspec.msgpack.encode(["x", []]), "ts is not a number"),
        (msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]), "unknown vLLM event type"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "lacks block_hashes"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", [-1], "GPU"]]]), "unsigned 64-bit"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU", 0, 0, 0, 0]]]), "fields"),
        (msgspec.msgpack.encode([1.0, [7]]), "map or a tagged array"),
    ],
)
def test_a_batch_that_cannot_be_read_says_why(payload: bytes, why: str) -> None:
    with pytest.raises(VllmEventError, match=why):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert seq_of((258).to_bytes(8, "big")) == 258
    with pytest.raises(VllmEventError):
        seq_of(b"\x01")
    assert seq_of((2**63 - 1).to_bytes(8, "big")) == 2**63 - 1
    # past the contract's int64 engine_seq: refused as malformed, not written as a varint
    # no reader takes (the relay skips such a frame, or treats a replay answer as none)
    with pytest.raises(VllmEventError, match="past int64"):
        seq_of((2**63).to_bytes(8, "big"))


def test_the_engine_sequence_rule() -> None:
    s = EngineSequence(remember=3)
    assert s.classify(0, 10) is Seen.NEXT and s.classify(2, 10) is Seen.GAP
    for seq in range(5):
        s.relayed(seq, 100 + seq)
    assert s.classify(5, 0) is Seen.NEXT
    assert s.classify(9, 0) is Seen.GAP
    assert s.classify(4, 104) is Seen.DUPLICATE  # replay and live overlap
    assert s.classify(4, 999) is Seen.RESTART  # an old number, newer than anything relayed
    assert s.classify(0, 100) is Seen.DUPLICATE  # a stale copy (not remembered, not newer)
    assert s.classify(0, 105) is Seen.RESTART
    s.committed()
    s.relayed(5, 105)
    s.reset()  # a new process, then the transaction is aborted
    s.relayed(0, 500)
    s.rewind(4)
    assert (s.last, s.time_of(4), s.time_of(5), s.newest_ms) == (4, 104, None, 104)


def test_partial_tails_are_fitted_to_the_spec_and_nothing_else_is() -> None:
    spec = GroupSpec("m", 1, "full_attention", 16, 4)
    tail = BlockStored((b"a", b"b"), None, tuple(range(8)), 4, None, "CPU", None, group_idx=1)
    assert fit_to_spec(tail, spec).partial  # type: ignore[union-attr]
    full = BlockStored((b"a",), None, tuple(range(16)), 16, None, "CPU", None, group_idx=1)
    assert fit_to_spec(full, spec) == full
    odd = BlockStored((b"a",), None, tuple(range(8)), 8, None, "CPU", None, group_idx=1)
    assert fit_to_spec(odd, spec) == odd  # neither size: left for the consumer to reject
    assert fit_to_spec(tail, None) == tail
    same = GroupSpec("m", 0, "full_attention", 4, 4)
    assert not fit_to_spec(tail, same).partial  # type: ignore[union-attr]


def test_endpoints_and_group_flags() -> None:
    assert offset_endpoint("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5559"
    assert offset_endpoint("tcp://h:5557", 0) == "tcp://h:5557"
    assert offset_endpoint("inproc://x", 1) == "inproc://x_dp1"
    assert parse_group("1:mamba:16", "m") == GroupSpec("m", 1, "mamba", 16, 16)
    assert parse_group("0:full_attention:16:4", "m").hash_block_size == 4
    with pytest.raises(ValueError, match="IDX:KIND"):
        parse_group("0:full", "m")


@pytest.mark.parametrize(
    ("flag", "reason"),
    [
        ("0:full:16", "unknown spec kind 'full'"),
        ("1:full_attention:0", "block sizes must be positive"),
        ("0:full_attention:16:5", "not a multiple of hash size 5"),
        ("-1:full_attention:16", "IDX must not be negative"),
    ],
)
def test_a_group_no_consumer_would_take_is_refused_at_start(flag: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_group(flag, "m")


@pytest.mark.parametrize(
    ("engine", "endpoint", "replay"),
    [
        ("vllm", "127.0.0.1:25557", None),  # no scheme: a ZMQError once it ran
        ("sglang", "http://127.0.0.1:25557", None),
        ("vllm", "tcp://127.0.0.1:25557", "127.0.0.1:25558"),
        ("vllm", "tcp://host", None),
    ],
)
def test_an_endpoint_no_socket_can_use_is_refused_at_start(
    engine: str, endpoint: str, replay: str | None
) -> None:
    with pytest.raises(ValueError, match="ZMQ endpoint is tcp://HOST:PORT"):
        RelayConfig(endpoint, "s", "m", "b:9092", replay_endpoint=replay, engine=engine)
    for good in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://engine-0.svc:5557",
                 "ipc:///tmp/kv", "inproc://kv"):  # fmt: skip
        RelayConfig(good, "s", "m", "b:9092", engine=engine)


@pytest.mark.parametrize("positional", [False, True], ids=["tagged maps", "positional arrays"])
def test_the_typed_reading_agrees_with_the_field_by_field_one(positional: bool) -> None:
    import random

    from kvledger.producer.relay.wire import _POSITIONAL, _TAGGED, _decode_fields

    rng = random.Random(3)
    for _ in range(200):
        events = []
        for _ in range(rng.randint(0, 4)):
            n = rng.randint(1, 3)
            hashes = [rng.choice([rng.getrandbits(64), rng.randbytes(32)]) for _ in range(n)]
            optional = {
                "group_idx": rng.choice([None, 0, 2]),
                "ownership": rng.choice([None, "disk"]),
                "extra_keys": rng.choice([None, [["salt", 1]] * n]),
                "lora_name": rng.choice([None, "a"]),
                "kv_cache_spec_kind": rng.choice([None, "mamba"]),
            }
            kind = rng.random()
            if kind < 0.6:
                parent = rng.choice([None, rng.getrandbits(64)])
                events.append(stored(hashes, parent, list(range(4 * n)), 4, "CPU", **optional))
            elif kind < 0.9:
                events.append(removed(hashes, rng.choice(["GPU", None]),
                                      group_idx=optional["group_idx"]))  # fmt: skip
            else:
                events.append(cleared())
        payload = encode_batch(rng.random() * 1e9, events, rng.choice([None, 1]), positional)
        (_POSITIONAL if positional else _TAGGED).decode(payload)  # the typed reading takes it
        assert decode_batch(payload) == _decode_fields(payload)
