"""Lookup requests as the HTTP API takes them: JSON values in, typed requests out (pure).

Every malformed body raises :class:`BadRequestError` with a reason a client can act on.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.hashing import int_to_hash_bytes
from kvledger.serving.lookup.api import DEFAULT_TIER_WEIGHTS, GRANULARITIES, Granularity

MAX_BODY_BYTES = 1 << 20
MAX_HASHES = 8192
MAX_TOKENS = 262_144
MAX_NAME_CHARS = 512
FIELDS = frozenset(
    {
        "model",
        "group_idx",
        "weights",
        "hashes",
        "token_ids",
        "granularity",
        "at",
        "lora_name",
        "cache_salt",
        "include_silent",
        "silent_after_s",
        "state_group",
        "load",
    }
)


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
    cache_salt: str | None = None  # with token_ids: the salt the engine hashed the prompt with
    # With hashes: a hybrid model's recurrent group, whose deepest state checkpoint within
    # each holder's prefix the answer says.
    state_group: int | None = None
    load: bool = False  # the answer also gives each live engine's load (its relay's reading)


def parse_hash(value: object) -> bytes:
    """A hash in a JSON body: hex text (``0x`` optional) or a 64-bit integer, vLLM's
    unsigned form or SGLang's signed one (the same 8 bytes)."""
    if isinstance(value, str):
        try:
            return bytes.fromhex(value.removeprefix("0x"))
        except ValueError:
            raise BadRequestError(f"not a hex hash: {value[:80]!r}") from None
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 64:
        return int_to_hash_bytes(value)  # signed (SGLang's) or unsigned (vLLM's): 8 bytes
    raise BadRequestError("hashes are hex strings or 64-bit integers (signed or unsigned)")


def parse_path_hash(text: str) -> list[bytes]:
    """The hashes a URL path's text can name, most likely first: there a number and hex
    are both text. ``0x`` + hex is hex; ``-`` and digits are SGLang's signed 64-bit form;
    digits alone are vLLM's unsigned 64-bit integer form, and also hex when they are an even
    number of them (``bytes.hex()`` of a hash whose hex has no letter), hex first; anything
    else is hex."""
    digits = text[1:] if text.startswith("-") else ""
    if digits.isascii() and digits.isdigit() and len(digits) <= 19 and int(text) >= -(1 << 63):
        return [int_to_hash_bytes(int(text))]  # SGLang's signed form
    if text.startswith("0x") or not (text.isascii() and text.isdigit()):
        return [parse_hash(text)]
    out = [bytes.fromhex(text)] if len(text) % 2 == 0 else []
    if len(text) <= 20 and int(text) < 1 << 64:
        out.append(int_to_hash_bytes(int(text)))
    if not out:
        raise BadRequestError(f"not a hex hash nor an unsigned 64-bit one: {text[:80]!r}")
    return out


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body: a JSON object of finite numbers, not nested without end."""

    def no_constant(name: str) -> object:
        raise BadRequestError(f"{name} is not a number this API takes")

    try:
        data = json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise BadRequestError("body nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, BadRequestError):
            raise
        raise BadRequestError("body is not JSON") from None
    if not isinstance(data, dict):
        raise BadRequestError("body must be a JSON object")
    if not_text(raw, data):
        raise BadRequestError("body holds a string that is not valid text (a lone surrogate)")
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def not_text(raw: bytes, data: object) -> bool:
    """Whether JSON ``data``, parsed from ``raw``, holds a string no UTF-8 can carry (a lone
    surrogate, which only a ``\\ud800``-style escape can make): such a name would fail
    every encoding after it. The body is searched before any string is walked."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return False
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return False


def _model_and_group(data: Mapping[str, Any], fields: frozenset[str]) -> tuple[str, int]:
    """A body's model and group, once it names no field outside ``fields``."""
    unknown = sorted(set(data) - fields)
    if unknown:
        raise BadRequestError(f"unknown field(s): {', '.join(map(str, unknown))[:200]}")
    model = data.get("model")
    group = data.get("group_idx", 0)
    if not isinstance(model, str) or not model:
        raise BadRequestError("model (string) is required")
    _name("model", model)
    if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < 2**31:
        raise BadRequestError("group_idx must be an integer in 0..2^31-1")
    return model, group


def _prompt(data: Mapping[str, Any]) -> tuple[Any, Any]:
    """The body's hashes and token ids, exactly one of them given (not checked further)."""
    hashes, tokens = data.get("hashes"), data.get("token_ids")
    if (hashes is None) == (tokens is None):
        raise BadRequestError("give exactly one of hashes or token_ids")
    return hashes, tokens


def _hashes(hashes: object) -> list[bytes]:
    if not isinstance(hashes, list) or not hashes or len(hashes) > MAX_HASHES:
        raise BadRequestError(f"hashes must be a list of 1..{MAX_HASHES}")
    return [parse_hash(h) for h in hashes]


def parse_match(data: Mapping[str, Any]) -> MatchRequest:
    model, group = _model_and_group(data, FIELDS)
    weights = data.get("weights", dict(DEFAULT_TIER_WEIGHTS))
    if not isinstance(weights, dict) or not all(
        isinstance(k, str)
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and abs(v) < 1e12
        for k, v in weights.items()
    ):
        raise BadRequestError("weights must map medium to a finite number")
    hashes, tokens = _prompt(data)
    include_silent = data.get("include_silent", False)
    if not isinstance(include_silent, bool):
        raise BadRequestError("include_silent must be true or false")
    silent_after = _seconds(data.get("silent_after_s"))
    load = _load_flag(data)
    granularity = data.get("granularity", "block")
    if granularity not in GRANULARITIES:
        raise BadRequestError(f"granularity must be one of {', '.join(GRANULARITIES)}")
    if tokens is not None:
        if granularity != "block":
            raise BadRequestError("granularity applies to hashes, not token_ids")
        if data.get("state_group") is not None:
            raise BadRequestError("state_group applies to hashes, not token_ids, for now")
        if data.get("at") is not None:
            raise BadRequestError("at applies to hashes; token_ids lookups answer for now")
        return MatchRequest(
            model,
            group,
            weights,
            token_ids=_tokens(tokens),
            lora_name=_lora(data),
            include_silent=include_silent,
            silent_after=silent_after,
            cache_salt=_text(data, "cache_salt"),
            load=load,
        )
    if data.get("cache_salt") is not None:
        raise BadRequestError("cache_salt applies to token_ids (a hash already includes it)")
    prompt = _hashes(hashes)
    state_group = data.get("state_group")
    if state_group is not None:
        if type(state_group) is not int or not 0 <= state_group < 2**31:
            raise BadRequestError("state_group must be an integer in 0..2^31-1")
        if granularity != "block" or data.get("at") is not None:
            raise BadRequestError("state_group applies to block hashes, for now")
    return MatchRequest(
        model,
        group,
        weights,
        prompt,
        granularity,
        _at(data.get("at")),
        include_silent=include_silent,
        silent_after=silent_after,
        state_group=state_group,
        load=load,
    )


def _load_flag(data: Mapping[str, Any]) -> bool:
    load = data.get("load", False)
    if not isinstance(load, bool):
        raise BadRequestError("load must be true or false")
    if load and data.get("at") is not None:
        raise BadRequestError("load is the engines' load now; it does not apply with at")
    return load


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
    return _text(data, "lora_name")


def _text(data: Mapping[str, Any], field: str) -> str | None:
    value = data.get(field)
    if value is not None and not isinstance(value, str):
        raise BadRequestError(f"{field} must be a string")
    if value is not None:
        _name(field, value)
    return value


def _name(field: str, value: str) -> None:
    if "\x00" in value:
        raise BadRequestError(f"{field} contains a NUL character")
    if len(value) > MAX_NAME_CHARS:
        raise BadRequestError(f"{field} is longer than {MAX_NAME_CHARS} characters")


def _at(at: object) -> datetime | None:
    if at is None:
        return None
    if not isinstance(at, str) or len(at) > 64:
        raise BadRequestError("at must be an ISO 8601 time")
    try:
        when = datetime.fromisoformat(at)
    except ValueError:
        raise BadRequestError("at must be an ISO 8601 time") from None
    if when.tzinfo is None:
        raise BadRequestError("at needs a time zone")
    return when


DECISION_FIELDS = frozenset(
    {
        "model",
        "group_idx",
        "instance",
        "hashes",
        "token_ids",
        "lora_name",
        "cache_salt",
        "request_id",
    }
)


@dataclass(frozen=True, slots=True)
class DecisionRequest:
    """POST /v1/decisions: a router sent the prompt (by token ids or block hashes) to
    ``instance``."""

    model: str
    group_idx: int
    instance: str
    hashes: list[bytes] | None = None
    token_ids: list[int] | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None


def parse_decision(data: Mapping[str, Any]) -> DecisionRequest:
    model, group = _model_and_group(data, DECISION_FIELDS)
    instance = data.get("instance")
    if not isinstance(instance, str) or not instance:
        raise BadRequestError("instance (string) is required: the instance the prompt went to")
    _name("instance", instance)
    request_id = _text(data, "request_id")
    hashes, tokens = _prompt(data)
    if tokens is not None:
        return DecisionRequest(
            model,
            group,
            instance,
            token_ids=_tokens(tokens),
            lora_name=_lora(data),
            cache_salt=_text(data, "cache_salt"),
            request_id=request_id,
        )
    for name in ("lora_name", "cache_salt"):
        if data.get(name) is not None:
            raise BadRequestError(f"{name} applies to token_ids (a hash already includes it)")
    return DecisionRequest(model, group, instance, hashes=_hashes(hashes), request_id=request_id)
