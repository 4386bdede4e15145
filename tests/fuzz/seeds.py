"""`python -m tests.fuzz.seeds [TARGET ...]`: writes the seed corpus
(tests/fuzz/corpus/TARGET/): valid inputs of each entry point and the malformed ones that
once broke kvledger, so that every fuzz run starts from them (and
tests/unit/test_fuzz_targets.py replays them)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

import msgspec

from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import Envelope, EventsLost
from tests.helpers.streams import edge_stream, fleet_stream

CORPUS = Path(__file__).parent / "corpus"


def _envelopes() -> list[bytes]:
    messages = [m.value for m in edge_stream().messages]
    fleet = [m.value for m in fleet_stream(FleetConfig(instances=2, requests=8, seed=4)).messages]
    lost = Codec().encode(Envelope("engine-0", "m", 0, 1, 8, 2, EventsLost(3, 9, group_idx=0)))
    at = _event_union_at(lost)
    malformed = [
        lost[:at] + b"\x01" + lost[at + 1 :],  # a negative union branch
        lost[:at] + bytes([lost[at] | 0x80]) + b"\x80" * 9 + b"\x00" + lost[at + 1 :],  # 11 bytes
        lost[:at] + bytes([lost[at] | 0x80]) + b"\x80" * 8 + b"\x02" + lost[at + 1 :],  # > 64 bits
    ]
    return messages + fleet[::7] + malformed


def _event_union_at(data: bytes) -> int:
    """Where the event union's branch number sits: after the 10-byte header, source, model,
    dp_rank, epoch, seq and event_time."""
    from tests.helpers.avro_strict import read_long

    pos = 10
    for _ in range(2):  # two strings
        n, pos = read_long(data, pos)
        pos += n
    for _ in range(4):
        _, pos = read_long(data, pos)
    return pos


def _batches() -> list[bytes]:
    stored = {
        "type": "BlockStored", "block_hashes": [1, 2**64 - 1], "parent_block_hash": None,
        "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
    }  # fmt: skip
    removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}
    positional = ["BlockStored", [5], 1, list(range(16)), 16, None, "CPU", None]
    lookahead = {**stored, "block_hashes": [1], "lookahead_token_ids": [[]] * 20_000}
    long = {**stored, "block_hashes": list(range(1, 601)), "token_ids": list(range(9600))}
    deep = {**stored, "extra_keys": [msgspec.Raw(b"\x91" * 100_000 + b"\xc0"), None]}
    return [
        msgspec.msgpack.encode(batch)
        for batch in (
            [1_764_000_000.5, [stored, removed], 0],
            [1.0, [{"type": "AllBlocksCleared"}]],
            [2.0, [positional, ["BlockRemoved", [5], "CPU"]], 1],
            [3.0, [{**stored, "extra_keys": [["lora", 1], None], "group_idx": 1}]],
            [4.0, [lookahead]],  # more lookahead lists than hashes: overflowed the C writer
            [5.0, [{**stored, "block_hashes": [-5]}]],  # a signed hash
            # Each of these once stopped the relay, and its replay stopped the next one.
            [float("nan"), [stored]],
            [float("inf"), [stored]],
            [1e16, [stored]],
            [6.0, [stored], 2**62],  # a rank past the envelope's int
            [7.0, [deep]],  # nested past the decoder's recursion limit
            [8.0, [long]],  # larger than a message: split
        )
    ]


def _sglang_batches() -> list[bytes]:
    stored = {
        "type": "BlockStored", "block_hashes": [1, -1], "parent_block_hash": None,
        "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
        "cache_salt": "t", "session_id": None, "lora_name": None,
    }  # fmt: skip
    removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU_PINNED"}
    return [
        msgspec.msgpack.encode(batch)
        for batch in (
            [1_764_000_000.5, [stored, removed], 0],
            [1.0, [{"type": "AllBlocksCleared"}]],
            [2.0, [{**stored, "medium": "EXTERNAL"}]],
            [3.0, [{**stored, "medium": "TAPE"}]],  # refused by name
            [float("nan"), [stored]],
            [-float("inf"), [removed]],
            [4.0, [stored], 2**62],
            [5.0, [{**stored, "lora_name": msgspec.Raw(b"\x91" * 100_000 + b"\xc0")}]],
        )
    ]


def _trtllm_events() -> list[bytes]:
    def tokens(ids: range) -> list[dict[str, object]]:
        return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]

    block = {"type": "stored_block", "block_hash": -3, "tokens": tokens(range(16)),
             "cache_level": 0, "priority": 35}  # fmt: skip
    stored = {"type": "stored", "parent_hash": None, "blocks": [block, {**block, "block_hash": 4}]}
    moved = {"type": "updated", "block_hash": 4,
             "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1}}  # fmt: skip
    events = [
        {"event_id": 1, "window_size": 4096, "data": stored},
        {"event_id": 2, "window_size": 4096, "data": moved, "attention_dp_rank": 0},
        {"event_id": 3, "window_size": 4096, "data": {"type": "removed", "block_hashes": [4]}},
        {"event_id": 4, "window_size": [1], "data": stored},  # unhashable: stopped the relay
        {"event_id": 5, "window_size": {"a": 1}, "data": stored},
        {"event_id": 6, "data": {"type": "created", "num_blocks_per_cache_level": [8, 8]}},
    ]
    wrapped = [json.dumps({"polled": 1_764_000_000.5, "event": e}).encode() for e in events]
    deep = b'{"polled": 1.0, "event": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nan = json.dumps({"polled": float("nan"), "event": events[0]}).encode()
    return [*wrapped, deep, nan]


def _dynamo_queries() -> list[bytes]:
    bodies = [
        b'{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "model_name": "m"}',
        b'{"token_ids": [4294967295], "model_name": "m", "routing_group": "1", "lora_name": "a"}',
        b'{"token_ids": [], "model_name": "m"}',
        b'{"token_ids": [1.5], "model_name": "m"}',  # declined: msgspec reads it
        b'{"model_name": "\\ud800", "token_ids": [1]}',
    ]
    # The first byte picks the block size (targets.SIZES): every size, the first body.
    return [bytes([i]) + bodies[0] for i in range(10)] + [b"\x03" + body for body in bodies[1:]]


def _groups() -> list[bytes]:
    rng = random.Random(11)
    return [rng.randbytes(n) for n in (16, 64, 256, 1024, 4096)]


def _decision_records() -> list[bytes]:
    offer = {"instance": "e-0", "medium": "GPU", "ownership": "", "blocks": 3, "state": "live"}
    record = {
        "id": "0" * 32, "at": 1.7e9, "block_size": 16, "prompt_blocks": 4,
        "available_blocks": 3, "silent_blocks": 0, "offered": [offer],
    }  # fmt: skip
    chosen = {**record, "chosen_state": "live", "captured_blocks": 3, "captured_tier": "GPU"}
    head = {"model": "m", "group_idx": 0, "origin": "o"}
    bodies = [
        {"v": 1, **head, "instance": "e-0", "kind": "tokens", "keys": [1, 2**64 - 1]},
        {"v": 2, **head, "instance": "e-0", "kind": "hashes", "keys": [7], "record": chosen},
        {"v": 3, **head, "record": record},
        {"v": 3, **head, "record": chosen},  # refused: an answer names no choice
        {"v": 1, **head, "instance": "e-0", "kind": "tokens", "keys": [2**64]},  # refused
    ]
    return [json.dumps(b).encode() for b in bodies] + [b"", b"{", b"[]", b'{"v": 9}']


def _replays() -> list[bytes]:
    rng = random.Random(12)
    return [rng.randbytes(n) for n in (8, 32, 64, 128, 512)]


def main(names: list[str]) -> None:
    """Write the seeds of ``names`` (default: every target's)."""
    for name, make in (
        ("envelope", _envelopes), ("batch", _batches), ("sglang", _sglang_batches),
        ("trtllm", _trtllm_events), ("dynamo", _dynamo_queries), ("group", _groups),
        ("decisions", _decision_records), ("replay", _replays),
    ):  # fmt: skip
        if names and name not in names:
            continue
        seeds = make()
        folder = CORPUS / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for seed in seeds:
            (folder / hashlib.sha1(seed).hexdigest()[:16]).write_bytes(seed)
        print(f"{name}: {len(seeds)} seeds")


if __name__ == "__main__":
    main(sys.argv[1:])
