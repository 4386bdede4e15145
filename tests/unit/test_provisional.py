"""Provisional holders (serving/router/provisional.py): what a router's decision makes a
lookup answer, for how long, and within what memory."""

from __future__ import annotations

import random

import pytest

from kvledger.schemas.decisions import HASHES, TOKENS, Decision, decode, encode
from kvledger.schemas.dynamo import dynamo_block_hashes
from kvledger.serving.router.provisional import Provisional, chain_keys, hash_keys, token_keys

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def decided(instance: str, tokens: list[int], model: str = "m") -> Decision:
    return Decision(model, 0, instance, TOKENS, tuple(token_keys(tokens, BLOCK, None, None)))


def depths(p: Provisional, tokens: list[int], real: dict[str, int] | None = None) -> dict[str, int]:
    return p.depths("m", 0, TOKENS, token_keys(tokens, BLOCK, None, None), real or {})


PROMPT = list(range(40))  # 10 blocks


def test_keys_name_whole_prefixes_under_adapter_and_salt() -> None:
    keys = token_keys(PROMPT, BLOCK, None, None)
    assert len(keys) == 10 and len(set(keys)) == 10
    assert token_keys([*PROMPT, 1, 2], BLOCK, None, None) == keys  # a partial tail: no key
    assert token_keys(PROMPT[:20], BLOCK, None, None) == keys[:5]
    other = list(PROMPT)
    other[1] = 999  # the first block differs: every key after it differs too
    assert not set(token_keys(other, BLOCK, None, None)) & set(keys)
    assert token_keys(PROMPT, BLOCK, "adapter", None)[0] != keys[0]
    assert token_keys(PROMPT, BLOCK, None, "salt")[0] != keys[0]
    # /query's path: Dynamo's local hashes, chained the same way
    assert chain_keys(dynamo_block_hashes(PROMPT, BLOCK, None)) == keys
    assert hash_keys([bytes([i]) * 8 for i in range(3)]) == [
        int.from_bytes(bytes([i]) * 8, "big") for i in range(3)
    ]


def test_a_decision_is_answered_until_its_window_ends() -> None:
    clock = Clock()
    p = Provisional(ttl_s=5, clock=clock)
    assert p.add(decided("a", PROMPT)) == 10
    assert depths(p, PROMPT) == {"a": 10}
    assert depths(p, PROMPT[:24]) == {"a": 6}  # a shorter prompt: its own prefix
    assert depths(p, PROMPT + list(range(100, 108))) == {"a": 10}  # a longer one: the shared part
    assert depths(p, list(range(500, 540))) == {}
    assert p.in_flight() == {"a": 1}
    clock.now += 4.9
    assert depths(p, PROMPT) == {"a": 10}
    clock.now += 0.2
    assert depths(p, PROMPT) == {}
    assert p.in_flight() == {} and len(p) == 0 and p.stats.expired == 1
    assert p.empty("m", 0, TOKENS)


def test_the_index_confirming_the_blocks_ends_the_claim() -> None:
    clock = Clock()
    p = Provisional(ttl_s=5, clock=clock)
    p.add(decided("a", PROMPT))
    p.add(decided("b", PROMPT[:16]))
    # a really holds 3 blocks: provisional answers the rest of the run, through them
    assert depths(p, PROMPT, {"a": 3}) == {"a": 10, "b": 4}
    # b's engine stored all 4 blocks it was sent: confirmed, no longer in flight
    assert depths(p, PROMPT, {"a": 3, "b": 4}) == {"a": 10}
    assert p.in_flight() == {"a": 1} and p.stats.confirmed == 1
    # a's engine stored everything: nothing provisional left; an eviction later does not
    # bring the claim back
    assert depths(p, PROMPT, {"a": 10}) == {}
    assert depths(p, PROMPT, {}) == {}
    assert p.in_flight() == {}


def test_a_real_holder_deeper_than_the_decision_is_not_claimed_less() -> None:
    p = Provisional(ttl_s=5, clock=Clock())
    p.add(decided("a", PROMPT[:8]))
    assert depths(p, PROMPT, {"a": 6}) == {}  # holds more than it was sent


def test_a_later_decision_keeps_the_blocks_an_earlier_one_expires() -> None:
    clock = Clock()
    p = Provisional(ttl_s=5, clock=clock)
    p.add(decided("a", PROMPT))
    clock.now += 3
    p.add(decided("a", PROMPT[:20]))
    clock.now += 2.5  # the first has expired, the second has not
    assert depths(p, PROMPT) == {"a": 5}
    assert p.in_flight() == {"a": 1}


def test_memory_is_bounded_oldest_first() -> None:
    clock = Clock()
    p = Provisional(ttl_s=60, max_blocks=100, max_prompt_blocks=20, clock=clock)
    rng = random.Random(3)
    prompts = [[rng.randrange(1 << 20) for _ in range(200)] for _ in range(30)]
    for i, prompt in enumerate(prompts):
        assert p.add(decided(f"i{i % 3}", prompt)) == 20  # cut to max_prompt_blocks
        assert p._blocks <= 100
    assert p.stats.evicted == 25 and len(p) == 5
    assert depths(p, prompts[0]) == {}
    assert depths(p, prompts[-1]) == {"i2": 20}
    assert sum(p.in_flight().values()) == 5


def test_spaces_are_apart() -> None:
    p = Provisional(ttl_s=5, clock=Clock())
    p.add(decided("a", PROMPT))
    assert p.depths("other", 0, TOKENS, token_keys(PROMPT, BLOCK, None, None), {}) == {}
    assert p.depths("m", 1, TOKENS, token_keys(PROMPT, BLOCK, None, None), {}) == {}
    hashes = [bytes([i]) * 8 for i in range(1, 5)]
    p.add(Decision("m", 0, "b", HASHES, tuple(hash_keys(hashes))))
    assert p.depths("m", 0, HASHES, hash_keys(hashes[:2]), {}) == {"b": 2}
    assert p.depths("m", 0, HASHES, token_keys(PROMPT, BLOCK, None, None), {}) == {}


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Provisional(ttl_s=0)


def test_the_wire_form_reads_back_and_refuses_what_is_not_a_decision() -> None:
    d = Decision("m", 2, "engine-1", TOKENS, (1, 2, (1 << 64) - 1), "origin", "req-7")
    assert decode(encode(d)) == d
    for bad in (
        b"", b"{}", b"[1]", b"not json",
        encode(d).replace(b'"v":1', b'"v":2'),
        encode(d).replace(b'"tokens"', b'"bytes"'),
        encode(d).replace(b"18446744073709551615", b"18446744073709551616"),
        encode(d).replace(b'"model":"m"', b'"model":""'),
        encode(d)[:-1] + b',"extra":1}',
        b"[" * 100_000,
        b" " * (600 * 1024),
    ):  # fmt: skip
        with pytest.raises(ValueError):
            decode(bad)


def test_the_same_prompt_sent_twice_is_two_in_flight_until_confirmed() -> None:
    p = Provisional(ttl_s=5, clock=Clock())
    p.add(decided("a", PROMPT[:16]))
    p.add(decided("a", PROMPT))
    assert p.in_flight() == {"a": 2}
    assert depths(p, PROMPT, {"a": 4}) == {"a": 10}  # the first is confirmed, not the second
    assert p.in_flight() == {"a": 1}
    assert depths(p, PROMPT, {"a": 10}) == {}
    assert p.in_flight() == {}


def test_a_prompt_sharing_a_prefix_does_not_confirm_another() -> None:
    p = Provisional(ttl_s=5, clock=Clock())
    p.add(decided("a", PROMPT))
    other = PROMPT[:8] + list(range(700, 732))  # the first 2 blocks shared, 10 in all
    assert depths(p, other, {"a": 10}) == {}
    assert p.in_flight() == {"a": 1}  # P's other 8 blocks are not known to be there
    assert depths(p, PROMPT, {"a": 2}) == {"a": 10}
