"""Tracker + encode events/s on realistic requests, beside encode alone.

Requests: 2k-token prompts, 16-token blocks (hash = block), 64-token chunks (4 blocks per
chunk): per request 32 record_store calls, one take_events, and every event encoded.
"""

from __future__ import annotations

import random

from bench.common import rate, record
from kvledger.producer.tracker import (
    GroupOffloadConfig,
    Medium,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    make_offload_key,
)
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import Envelope

GROUP = GroupOffloadConfig(0, 16, 64, 4, OffloadingEventGroupSpec("full_attention", None))
PROMPT_TOKENS = 2048


class _Req:
    __slots__ = ("all_token_ids", "block_hashes", "lora_request")

    def __init__(self, rng: random.Random) -> None:
        self.all_token_ids = [rng.randrange(32000) for _ in range(PROMPT_TOKENS)]
        self.block_hashes = [rng.randbytes(8) for _ in range(PROMPT_TOKENS // 16)]
        self.lora_request = None


def main(requests: int = 300) -> dict[str, float]:
    rng = random.Random(0)
    reqs = [_Req(rng) for _ in range(requests)]
    codec = Codec()
    chunks = PROMPT_TOKENS // GROUP.tokens_per_chunk

    def tracker_and_encode() -> list[bytes]:
        tracker = OffloadingEventsTracker()
        out = []
        seq = 0
        for req in reqs:
            keys = []
            for chunk in range(chunks):
                key = make_offload_key(req.block_hashes[chunk * 4 + 3], 0)
                tracker.record_store(req, GROUP, chunk, key)
                keys.append(key)
            for event in tracker.take_events([OffloadingEvent(keys, Medium.CPU, removed=False)]):
                out.append(codec.encode(Envelope("engine-0", "m", 0, 1, seq, 2, event)))
                seq += 1
        return out

    events = requests * chunks
    translated = []
    tracker = OffloadingEventsTracker()
    for req in reqs:
        keys = [make_offload_key(req.block_hashes[c * 4 + 3], 0) for c in range(chunks)]
        for c, key in enumerate(keys):
            tracker.record_store(req, GROUP, c, key)
        translated.extend(tracker.take_events([OffloadingEvent(keys, Medium.CPU, removed=False)]))
    envelopes = [Envelope("engine-0", "m", 0, 1, i, 2, e) for i, e in enumerate(translated)]

    def encode_only() -> None:
        for env in envelopes:
            codec.encode(env)

    full = rate(events, tracker_and_encode)
    encode = rate(events, encode_only)
    figures = {
        "events": float(events),
        "tracker+encode events/s": full,
        "encode-only events/s": encode,
        "ratio tracker+encode / encode-only": full / encode,
        "blocks per event": 4.0,
    }
    record("tracker_encode", figures)
    return figures


if __name__ == "__main__":
    main()
