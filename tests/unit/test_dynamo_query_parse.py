"""The compiled core's reading of Dynamo's /query body (rust/src/dynamo_query.rs) is a fast
path: on every body it either declines or reads what the service's msgspec reading reads,
and its block hashes are Dynamo's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger._core import dynamo_packed_hashes, dynamo_token_query
from kvledger.schemas.dynamo import dynamo_block_hashes, dynamo_seed, packed_block_hashes
from kvledger.serving.lookup import dynamo_requests as api

_ints = st.one_of(
    st.integers(0, 2**32 - 1), st.integers(-(2**70), 2**70), st.booleans(), st.floats(),
)  # fmt: skip
_texts = st.one_of(st.text(max_size=8), st.none(), st.integers(), st.lists(st.integers()))
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": st.one_of(st.lists(_ints, max_size=40), _texts),
        "model_name": _texts,
        "routing_group": _texts,
        "lora_name": _texts,
        "cache_salt": _texts,
        "other": _texts,
    },
)


def _slow(raw: bytes) -> Any:
    """What the msgspec reading makes of ``raw``: its query, or its status and words."""
    saved = api._token_query
    api._token_query = None
    try:
        q = api.parse_query(raw, False)
        return (q.model, q.routing_group, q.lora_name, q.token_ids)
    except api.DynamoRequestError as exc:
        return (exc.status, str(exc))
    finally:
        api._token_query = saved


def _fast(raw: bytes) -> Any:
    got = dynamo_token_query(raw)
    if got is None:
        return None
    model, routing_group, lora_name, packed = got
    tokens = [int.from_bytes(packed[i : i + 4], "little") for i in range(0, len(packed), 4)]
    return (model, routing_group, lora_name or None, tokens)


@settings(max_examples=400, deadline=None)
@given(body=st.one_of(_bodies, st.lists(st.integers(), max_size=3)), spaces=st.booleans())
def test_the_fast_path_declines_or_reads_as_msgspec_does(body: Any, spaces: bool) -> None:
    raw = json.dumps(body, indent=1 if spaces else None).encode()
    fast = _fast(raw)
    if fast is not None:
        assert fast == _slow(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"token_ids": [1, 2], "model_name": "m", "model_name": "n"}',  # msgspec: the last
        b'{"token_ids": [1], "model_name": "m"} trailing',
        b'[[1], "m"]',
        b'{"token_ids": [1], "model_name": "m", "routing_group": null}',
        b'{"token_ids": [1e0], "model_name": "m"}',
        b'{"token_ids": [1], "model_name": "m", "cache_salt": "s"}',
    ],
)
def test_what_the_fast_path_declines(raw: bytes) -> None:
    assert dynamo_token_query(raw) is None


def test_packed_hashes_are_dynamos() -> None:
    tokens = [*range(40), 2**32 - 1, 2**31, 7, 9]
    packed = b"".join(t.to_bytes(4, "little") for t in tokens)
    for lora in (None, "adapter-a"):
        want = dynamo_block_hashes(tokens, 4, lora)
        assert dynamo_packed_hashes(packed, 4, dynamo_seed(lora)) == want
        assert packed_block_hashes(packed, 4, dynamo_seed(lora)) == want  # the pure twin
        assert packed_block_hashes(packed + b"\x01\x00", 4, dynamo_seed(lora)) == want
    query = api.parse_query(json.dumps({"token_ids": tokens, "model_name": "m"}).encode(), False)
    assert query.packed == packed and query.token_ids is None
