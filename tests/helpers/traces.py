"""Traces of Mooncake's shape for the replay's tests: conversations whose turns extend their
own earlier prompts, under a few shared system prompts (so engines can reuse each other's
work, and a router can find it)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def conversation_trace(
    path: Path,
    conversations: int = 60,
    turns: int = 4,
    systems: int = 3,
    block_tokens: int = 512,
    gap_ms: int = 400,
    seed: int = 7,
) -> Path:
    """Write the trace to ``path``: conversations start ``gap_ms`` apart, each turn adds a
    few blocks to the conversation's prompt and a partial last block."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system = [fresh(rng.randint(2, 6)) for _ in range(systems)]
    requests: list[tuple[int, int, list[int]]] = []
    for c in range(conversations):
        chain = list(system[rng.randrange(systems)])
        at = c * gap_ms
        for _ in range(turns):
            chain += fresh(rng.randint(1, 5))
            tail = rng.randint(1, block_tokens - 1)
            tokens = len(chain) * block_tokens + tail
            requests.append((at, tokens, [*chain, *fresh(1)]))
            at += rng.randint(2, 20) * gap_ms
    requests.sort(key=lambda r: r[0])
    with path.open("w") as f:
        for at, tokens, ids in requests:
            record = {"timestamp": at, "input_length": tokens, "output_length": 8, "hash_ids": ids}
            f.write(json.dumps(record) + "\n")
    return path
