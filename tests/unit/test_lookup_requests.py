"""Parsing of lookup requests (consumer.lookup.requests): typed values or a 400's reason."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvledger.serving.lookup.requests import (
    MAX_HASHES,
    BadRequestError,
    MatchRequest,
    parse_hash,
    parse_match,
    parse_path_hash,
)


def test_hashes_as_hex_or_64_bit_integers_signed_or_unsigned() -> None:
    assert parse_hash("0x00ff") == b"\x00\xff" == parse_hash("00ff")
    assert parse_hash(2**64 - 1) == b"\xff" * 8 == parse_hash(-1)  # vLLM's and SGLang's forms
    assert parse_hash(-(2**63)) == b"\x80" + b"\x00" * 7 == parse_hash(2**63)
    assert parse_hash(5) == (5).to_bytes(8, "big")
    for bad in ("zz", -(2**63) - 1, 2**64, True, 1.5, None):
        with pytest.raises(BadRequestError):
            parse_hash(bad)
    assert parse_path_hash("-1") == [b"\xff" * 8]
    assert parse_path_hash("-9223372036854775808") == [b"\x80" + b"\x00" * 7]
    with pytest.raises(BadRequestError):
        parse_path_hash("-9223372036854775809")


def test_a_hash_request_with_defaults_and_an_instant() -> None:
    req = parse_match({"model": "m", "hashes": ["01", 2], "at": "2026-11-30T00:00:00+00:00"})
    assert req == MatchRequest(
        "m", 0, req.weights, [b"\x01", (2).to_bytes(8, "big")], "block",
        datetime(2026, 11, 30, tzinfo=UTC),
    )  # fmt: skip
    assert req.weights["GPU"] == 1.0


def test_a_token_request() -> None:
    req = parse_match({"model": "m", "group_idx": 2, "token_ids": [1, 2], "lora_name": "x"})
    assert (req.token_ids, req.lora_name, req.hashes, req.group_idx) == ([1, 2], "x", None, 2)
    assert req.cache_salt is None
    salted = parse_match({"model": "m", "token_ids": [1, 2], "cache_salt": "tenant-7"})
    assert salted.cache_salt == "tenant-7"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"hashes": ["01"]}, "model"),
        ({"model": "m", "group_idx": -1, "hashes": ["01"]}, "group_idx"),
        ({"model": "m", "group_idx": True, "hashes": ["01"]}, "group_idx"),
        ({"model": "m"}, "exactly one"),
        ({"model": "m", "hashes": ["01"], "token_ids": [1]}, "exactly one"),
        ({"model": "m", "hashes": []}, "hashes must be"),
        ({"model": "m", "hashes": ["01"] * (MAX_HASHES + 1)}, "hashes must be"),
        ({"model": "m", "hashes": ["01"], "granularity": "page"}, "granularity"),
        ({"model": "m", "token_ids": [1], "granularity": "hash"}, "granularity"),
        ({"model": "m", "token_ids": [1], "at": "2026-11-30T00:00:00+00:00"}, "at applies"),
        ({"model": "m", "token_ids": [2**31]}, "int32"),
        ({"model": "m", "token_ids": [True]}, "int32"),
        ({"model": "m", "token_ids": [1], "lora_name": 3}, "lora_name"),
        ({"model": "m", "token_ids": [1], "cache_salt": 7}, "cache_salt must be a string"),
        ({"model": "m", "token_ids": [1], "cache_salt": "a\x00b"}, "cache_salt contains a NUL"),
        ({"model": "m", "hashes": ["01"], "cache_salt": "s"}, "cache_salt applies to token_ids"),
        ({"model": "m", "hashes": ["01"], "at": "yesterday"}, "ISO 8601"),
        ({"model": "m", "hashes": ["01"], "at": "2026-11-30T00:00:00"}, "time zone"),
        ({"model": "m", "hashes": ["01"], "weights": {"GPU": "high"}}, "weights"),
        ({"model": "m", "hashes": ["01"], "load": 1}, "load must be true or false"),
        (
            {"model": "m", "hashes": ["01"], "load": True, "at": "2026-11-30T00:00:00+00:00"},
            "does not apply with at",
        ),
    ],
)
def test_malformed_requests_say_why(body: dict[str, Any], reason: str) -> None:
    with pytest.raises(BadRequestError, match=reason):
        parse_match(body)


def test_the_load_is_asked_for_with_either_prompt() -> None:
    assert parse_match({"model": "m", "token_ids": [1], "load": True}).load
    assert parse_match({"model": "m", "hashes": ["01"], "load": True}).load
    assert not parse_match({"model": "m", "hashes": ["01"]}).load


def test_token_prompts_take_the_liveness_options_as_hashes_do() -> None:
    for prompt in ({"token_ids": [1, 2, 3]}, {"hashes": ["00" * 8]}):
        req = parse_match({"model": "m", "include_silent": True, "silent_after_s": 2.5, **prompt})
        assert req.include_silent is True and req.silent_after == timedelta(seconds=2.5), prompt


def test_a_hash_in_a_path_is_hex_or_the_unsigned_int_form() -> None:

    assert parse_path_hash("0x0102") == [b"\x01\x02"]
    assert parse_path_hash("ab01") == [b"\xab\x01"]
    assert parse_path_hash(str(2**64 - 1))[-1] == b"\xff" * 8
    assert parse_path_hash(str(2**63)) == [(2**63).to_bytes(8, "big")]  # 19 digits
    # Digits alone, an even count: hex first, then the int.
    assert parse_path_hash("12") == [b"\x12", (12).to_bytes(8, "big")]
    for bad in ("zz", str(2**64) + "1", "0xabc"):
        with pytest.raises(BadRequestError):
            parse_path_hash(bad)
