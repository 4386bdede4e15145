"""Lookup requests as the HTTP API takes them: JSON values in, typed requests out (pure).

Every malformed body raises :class:`BadRequestError` with a reason a client can act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kvledger.consumer.lookup.api import DEFAULT_TIER_WEIGHTS, GRANULARITIES, Granularity
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.hashing import int_to_hash_bytes

MAX_BODY_BYTES = 1 << 20
MAX_HASHES = 8192
MAX_TOKENS = 262_144


class BadRequestError(KvledgerError, ValueError):
    """A request the lookup service refuses (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class MatchRequest:
    """POST /v1/match: by block hashes (optionally as of ``at``) or by token ids."""

    model: str
    group_idx: int
    weights: Mapping[str, float]
    hashes: list[bytes] | None = None
    granularity: Granularity = "block"
    at: datetime | None = None
    token_ids: list[int] | None = None
    lora_name: str | None = None
    include_silent: bool = False
    silent_after: timedelta | None = None


def parse_hash(value: object) -> bytes:
    """A hash as hex text (``0x`` optional) or as vLLM's unsigned 64-bit integer form."""
    if isinstance(value, str):
        try:
            return bytes.fromhex(value.removeprefix("0x"))
        except ValueError:
            raise BadRequestError(f"not a hex hash: {value[:80]!r}") from None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64:
        return int_to_hash_bytes(value)
    raise BadRequestError("hashes are hex strings or unsigned 64-bit integers")


def parse_match(data: Mapping[str, Any]) -> MatchRequest:
    model = data.get("model")
    group = data.get("group_idx", 0)
    if not isinstance(model, str) or not model:
        raise BadRequestError("model (string) is required")
    if not isinstance(group, int) or isinstance(group, bool) or group < 0:
        raise BadRequestError("group_idx must be a non-negative integer")
    weights = data.get("weights", dict(DEFAULT_TIER_WEIGHTS))
    if not isinstance(weights, dict) or not all(
        isinstance(v, int | float) for v in weights.values()
    ):
        raise BadRequestError("weights must map medium to a number")
    hashes, tokens = data.get("hashes"), data.get("token_ids")
    if (hashes is None) == (tokens is None):
        raise BadRequestError("give exactly one of hashes or token_ids")
    include_silent = data.get("include_silent", False)
    if not isinstance(include_silent, bool):
        raise BadRequestError("include_silent must be true or false")
    silent_after = _seconds(data.get("silent_after_s"))
    granularity = data.get("granularity", "block")
    if granularity not in GRANULARITIES:
        raise BadRequestError(f"granularity must be one of {', '.join(GRANULARITIES)}")
    if tokens is not None:
        if granularity != "block":
            raise BadRequestError("granularity applies to hashes, not token_ids")
        if data.get("at") is not None:
            raise BadRequestError("at applies to hashes; token_ids lookups answer for now")
        return MatchRequest(model, group, weights, token_ids=_tokens(tokens), lora_name=_lora(data))
    if not isinstance(hashes, list) or not hashes or len(hashes) > MAX_HASHES:
        raise BadRequestError(f"hashes must be a list of 1..{MAX_HASHES}")
    return MatchRequest(
        model, group, weights, [parse_hash(h) for h in hashes], granularity, _at(data.get("at")),
        include_silent=include_silent, silent_after=silent_after,
    )  # fmt: skip


def _seconds(value: object) -> timedelta | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
        raise BadRequestError("silent_after_s must be a positive number of seconds")
    return timedelta(seconds=value)


def _tokens(tokens: object) -> list[int]:
    if (
        not isinstance(tokens, list)
        or not tokens
        or len(tokens) > MAX_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        or not all(-(2**31) <= t < 2**31 for t in tokens)
    ):
        raise BadRequestError(f"token_ids must be a list of 1..{MAX_TOKENS} int32")
    return tokens


def _lora(data: Mapping[str, Any]) -> str | None:
    lora = data.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise BadRequestError("lora_name must be a string")
    return lora


def _at(at: object) -> datetime | None:
    if at is None:
        return None
    try:
        when = datetime.fromisoformat(str(at))
    except ValueError:
        raise BadRequestError("at must be an ISO 8601 time") from None
    if when.tzinfo is None:
        raise BadRequestError("at needs a time zone")
    return when
