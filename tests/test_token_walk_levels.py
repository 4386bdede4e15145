"""Token walks over engines that hash one content differently (vLLM beside SGLang, vLLM's
xxhash variants, different PYTHONHASHSEEDs): each engine stores its own chain of the same
tokens, so every level of the walk has a block of each. Each holds the whole prompt, from
PostgreSQL (``held_tokens``, revision 0017) and from the router's memory alike; before,
the levels' blocks were taken as one list of positions and the first engine matched one
block, the second none."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kvledger.consumer.db import connect
from kvledger.consumer.pipeline import run_batch
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.schemas.events import BlockStored
from kvledger.schemas.lookup import Holder
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.router.index import RouterIndex
from tests.helpers.streams import MODEL, Stream, h, spec

pytestmark = pytest.mark.integration

WIDE = timedelta(days=3650)
PROMPT = [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 40, 41]  # three blocks and a tail


def _chain(s: Stream, source: str, first: int, tail: bool) -> None:
    """Three blocks of 4 tokens under hashes first, first + 1, first + 2 (and a 2-token
    partial tail under first + 9), all on GPU."""
    parent = None
    for i in range(3):
        tokens = tuple(PROMPT[4 * i : 4 * i + 4])
        s.send(source, BlockStored((h(first + i),), parent, tokens, 4, None, "GPU", None,
                                   group_idx=0, token_start=4 * i))  # fmt: skip
        parent = h(first + i)
    if tail:
        s.send(source, BlockStored((h(first + 9),), parent, (40, 41), 2, None, "GPU", None,
                                   group_idx=0, token_start=12, partial=True))  # fmt: skip


def test_engines_that_hash_alike_content_apart_each_hold_the_whole_prompt(
    fresh_database: str,
) -> None:
    s = Stream()
    for source in ("engine-a", "engine-b", "engine-c"):
        s.send(source, spec(0, block=4, hash_size=2))
    _chain(s, "engine-a", 100, tail=False)
    _chain(s, "engine-b", 200, tail=True)
    s.send("engine-c", BlockStored((h(300),), None, (0, 1, 2, 3), 4, None, "CPU", None,
                                   group_idx=0, token_start=0))  # fmt: skip
    router = RouterIndex("127.0.0.1:9")  # never connects: fed the messages directly
    with connect(fresh_database, autocommit=True) as conn:
        run_batch(s.messages, s.codec, PostgresStore(conn), "g")
        from_sql = PrefixIndex(conn).match_tokens(MODEL, 0, PROMPT, None, True, WIDE)
    run_batch(s.messages, s.codec, router.store, "g")
    from_memory = router.match_tokens(MODEL, 0, PROMPT, None, True, WIDE)
    want = [
        Holder("engine-b", "GPU", "", 3, 14),  # its tail too
        Holder("engine-a", "GPU", "", 3, 12),
        Holder("engine-c", "CPU", "", 1, 4),
    ]
    assert from_sql == want
    assert from_memory == from_sql
    # A prompt cut inside the second block: the first level only, for each.
    short = PROMPT[:6]
    with connect(fresh_database, autocommit=True) as conn:
        cut = PrefixIndex(conn).match_tokens(MODEL, 0, short, None, True, WIDE)
    assert {(x.instance, x.matched_blocks) for x in cut} == {
        ("engine-a", 1), ("engine-b", 1), ("engine-c", 1),
    }  # fmt: skip
    assert router.match_tokens(MODEL, 0, short, None, True, WIDE) == cut
