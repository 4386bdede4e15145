"""TensorRT-LLM's events read by `kvledger relay --engine trtllm` (producer/relay/trtllm.py),
pure: the serializer's JSON (tests/helpers/trtllm_fixture.py says where the shape is from)
into kvledger's events — tiers, tier moves, windows to groups, extra token ids — and what
is not that shape refused with its reason."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

import pytest

from kvledger.producer.relay.trtllm import TrtllmLink, TrtllmReader
from kvledger.producer.vllm import VllmEventError
from kvledger.schemas.events import BlockRemoved, BlockStored, GroupSpec

GROUPS = [GroupSpec("m", 0, "full_attention", 2, 2), GroupSpec("m", 2, "sliding_window", 2, 2,
                                                                 sliding_window=512)]  # fmt: skip


def payload(data: dict[str, Any], window: int = 4096, **more: Any) -> bytes:
    event = {"event_id": 5, "data": data, "window_size": window, **more}
    return json.dumps({"polled": 100.0, "event": event}).encode()


def block(h: int, tokens: list[int], level: int = 0, extra: int = 0) -> dict[str, Any]:
    return {"type": "stored_block", "block_hash": h, "cache_level": level, "priority": 35,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": extra}
                       for t in tokens]}  # fmt: skip


def diff(old: int, new: int) -> dict[str, Any]:
    return {"type": "event_diff", "old_value": old, "new_value": new}


def test_stores_moves_and_removals_by_tier() -> None:
    r = TrtllmReader(GROUPS)
    stored = {
        "type": "stored",
        "parent_hash": -1,
        "blocks": [block(1, [5, 6]), block(2, [7, 8]), block(3, [9, 9], level=1)],
    }
    batch = r.read_batch(payload(stored, attention_dp_rank=1))
    assert (batch.ts, batch.dp_rank) == (100.0, 1)
    gpu, cpu = batch.events
    assert isinstance(gpu, BlockStored) and isinstance(cpu, BlockStored)
    assert (gpu.block_hashes, gpu.parent_block_hash, gpu.token_ids, gpu.block_size, gpu.medium) == (
        ((1).to_bytes(8, "big"), (2).to_bytes(8, "big")), b"\xff" * 8, (5, 6, 7, 8), 2, "GPU",
    )  # fmt: skip
    assert (cpu.parent_block_hash, cpu.medium, cpu.group_idx) == ((2).to_bytes(8, "big"), "CPU", 0)
    moved = r.read_batch(payload({"type": "updated", "block_hash": 2, "cache_level": diff(0, 1),
                                  "priority": diff(35, 35)})).events  # fmt: skip
    assert [(type(e).__name__, e.medium) for e in moved] == [("BlockRemoved", "GPU"),
                                                             ("BlockStored", "CPU")]  # fmt: skip
    assert moved[1].token_ids == (7, 8) and moved[1].parent_block_hash == (1).to_bytes(8, "big")
    unknown = r.read_batch(payload({"type": "updated", "block_hash": 77,
                                    "cache_level": diff(0, 1)})).events  # fmt: skip
    assert isinstance(unknown[1], BlockStored) and unknown[1].block_size == 0  # a placeholder
    priority = {"type": "updated", "block_hash": 1, "priority": diff(35, 50)}
    assert r.read_batch(payload(priority)).events == []
    removed = r.read_batch(payload({"type": "removed", "block_hashes": [2, 1, 99]})).events
    assert sorted((e.medium, len(e.block_hashes)) for e in removed) == [("CPU", 1), ("GPU", 2)]
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert (
        r.read_batch(payload({"type": "created", "num_blocks_per_cache_level": [4]})).events == []
    )


def test_windows_pick_groups_and_extra_token_ids_are_extra_keys() -> None:
    r = TrtllmReader(GROUPS)
    data = {"type": "stored", "parent_hash": None, "blocks": [block(4, [1, 2], extra=3)]}
    (windowed,) = r.read_batch(payload(data, window=512)).events
    assert isinstance(windowed, BlockStored) and windowed.group_idx == 2
    assert windowed.extra_keys == ('["token_extra_ids", [3, 3]]',)
    (plain,) = r.read_batch(payload({**data, "blocks": [block(5, [1, 2])]}, window=9)).events
    assert isinstance(plain, BlockStored) and (plain.group_idx, plain.extra_keys) == (0, None)


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"<html>", "not a TensorRT-LLM KV cache event"),
        (payload({"type": "evicted"}), "unknown TensorRT-LLM event type 'evicted'"),
        (payload({"type": "stored", "parent_hash": None, "blocks": [block(1, [1], level=2)]}),
         "unknown TensorRT-LLM cache_level 2"),
        (payload({"type": "removed", "block_hashes": ["a"]}), "a block hash must be a 64-bit"),
        (payload({"type": "removed", "block_hashes": [2**64]}), "a block hash must be a 64-bit"),
        (payload({"type": "stored", "parent_hash": None}), "TensorRT-LLM stored event"),
        # Each of these once stopped the relay (and its restart, polling again).
        (payload({"type": "removed", "block_hashes": [1]}, window=[1]), "window_size is not"),
        (payload({"type": "removed", "block_hashes": [1]}, window={"a": 1}), "window_size is"),
        (b'{"polled": 1, "event": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
        (payload({"type": "removed", "block_hashes": [1]}).replace(b"100.0", b"NaN"), "ts nan"),
        (payload({"type": "removed", "block_hashes": [1]}).replace(b"100.0", b"1e16"), "ts 1e"),
        (payload({"type": "removed", "block_hashes": [1]}, attention_dp_rank=2**62), "rank"),
    ],
)  # fmt: skip
def test_what_is_not_that_shape_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(VllmEventError, match=why):
        TrtllmReader(GROUPS).read_batch(raw)


def test_a_trickled_answer_is_a_failed_poll_within_its_timeout() -> None:
    """An endpoint that answers one byte at a time (each within the read timeout) held a
    poll 40 s with a 5 s timeout: the whole answer now has that long."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n[")
            while not stop.wait(0.05):
                with contextlib.suppress(OSError):
                    conn.sendall(b" ")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    errors: list[int] = []
    link = TrtllmLink(
        f"http://127.0.0.1:{server.getsockname()[1]}",
        timeout_s=1.0,
        on_error=lambda: errors.append(1),
    )
    try:
        started = time.monotonic()
        assert link.receive(50) is None
        took = time.monotonic() - started
    finally:
        stop.set()
        link.close()
        server.close()
    assert link.failing and errors == [1]
    assert took < 2.5, took
