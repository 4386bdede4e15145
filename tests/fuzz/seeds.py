"""`python -m tests.fuzz.seeds`: writes the seed corpus (tests/fuzz/corpus/TARGET/): valid
inputs of each entry point and the malformed ones that once broke kvledger, so that every
fuzz run starts from them (and tests/unit/test_fuzz_targets.py replays them)."""

from __future__ import annotations

import hashlib
import random
import shutil
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
    from kvledger.schemas.avro_strict import read_long

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
    return [
        msgspec.msgpack.encode(batch)
        for batch in (
            [1_764_000_000.5, [stored, removed], 0],
            [1.0, [{"type": "AllBlocksCleared"}]],
            [2.0, [positional, ["BlockRemoved", [5], "CPU"]], 1],
            [3.0, [{**stored, "extra_keys": [["lora", 1], None], "group_idx": 1}]],
            [4.0, [lookahead]],  # more lookahead lists than hashes: overflowed the C writer
            [5.0, [{**stored, "block_hashes": [-5]}]],  # a signed hash
        )
    ]


def _groups() -> list[bytes]:
    rng = random.Random(11)
    return [rng.randbytes(n) for n in (16, 64, 256, 1024, 4096)]


def main() -> None:
    for name, seeds in (("envelope", _envelopes()), ("batch", _batches()), ("group", _groups())):
        folder = CORPUS / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for seed in seeds:
            (folder / hashlib.sha1(seed).hexdigest()[:16]).write_bytes(seed)
        print(f"{name}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
