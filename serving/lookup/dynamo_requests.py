"""Dynamo's KV-indexer requests (:mod:`.dynamo` answers them): their bodies read, typed and
bounded as Dynamo's server reads them, with its status codes; a /query prompt's Dynamo
block hashes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvledger.schemas.dynamo import dynamo_seed, packed_block_hashes
from kvledger.serving.lookup.requests import not_text

if TYPE_CHECKING:
    from kvledger.serving.router.groups import BlockGroup, SlotTable

try:
    from kvledger._core import dynamo_block_hashes as _native_hashes
    from kvledger._core import dynamo_packed_hashes as packed_block_hashes
    from kvledger._core import dynamo_token_query as _token_query
except ImportError:  # built without a Rust toolchain
    _native_hashes = _token_query = None  # type: ignore[assignment]

# Dynamo's own limit on a query's body ("one million tokens as JSON text").
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_TOKENS = 1 << 20
DEFAULT_ROUTING_GROUP = "default"
_U64 = (1 << 64) - 1

SALTED_HASHES = (
    "cache_salt is not accepted by /query_by_hash; block_hashes must already include the "
    "intended cache salt"
)
SALT_UNKNOWN = (
    "cache_salt is not supported here: kvledger does not know which salt an engine's blocks "
    "were hashed with"
)


class DynamoRequestError(ValueError):
    """A request refused with Dynamo's status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Query:
    model: str
    routing_group: str
    locals: list[int] | None  # Dynamo local hashes (query_by_hash)
    token_ids: list[int] | None
    lora_name: str | None
    packed: bytes | None = None  # or the token ids as u32 LE bytes (the core's reading)

    def answer(self, g: BlockGroup, block_size: int, slots: SlotTable, cut: int) -> bytes:
        """The query's answer (JSON) from ``g``: ``g.dynamo_answer`` of its blocks, from its
        packed token ids in one call where the core read the body (no Python int per
        hash)."""
        if self.packed is not None:
            seed = dynamo_seed(self.lora_name)
            return g.dynamo_answer_packed(self.packed, block_size, seed, slots, cut)
        return g.dynamo_answer(self.hashes(block_size), block_size, slots, cut)

    def blocks(self, block_size: int) -> int:
        """How many whole blocks of ``block_size`` tokens the query's prompt has."""
        if self.locals is not None:
            return len(self.locals)
        tokens = len(self.packed) // 4 if self.packed is not None else len(self.token_ids or ())
        return tokens // block_size

    def hashes(self, block_size: int) -> list[int]:
        """The Dynamo local block hashes of the query, for blocks of ``block_size``
        tokens."""
        if self.locals is not None:
            return self.locals
        if self.packed is not None:
            return packed_block_hashes(self.packed, block_size, dynamo_seed(self.lora_name))
        assert self.token_ids is not None
        return local_hashes(self.token_ids, block_size, self.lora_name)


# ---------------------------------------------------------------------- parsing
def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise DynamoRequestError(
            400, "Failed to parse the request body as JSON: nested too deeply"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DynamoRequestError(400, f"Failed to parse the request body as JSON: {exc}") from None
    if not isinstance(body, dict):
        raise DynamoRequestError(422, "Failed to deserialize the JSON body: expected an object")
    if not_text(raw, body):
        raise DynamoRequestError(
            400,
            "Failed to parse the request body as JSON: a string that "
            "is not valid text (a lone surrogate)",
        )
    return body


def field(
    body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    value = body.get(name, default)
    if value is ...:
        raise DynamoRequestError(
            422, f"Failed to deserialize the JSON body: missing field `{name}`"
        )
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DynamoRequestError(
            422, f"Failed to deserialize the JSON body: `{name}` has the wrong type"
        )
    return value


def int_field(values: list[Any], name: str, low: int, high: int, limit: int) -> list[int]:
    if len(values) > limit:
        raise DynamoRequestError(413, f"`{name}` has {len(values)} items, over {limit}")
    for v in values:
        if type(v) is not int or not low <= v < high:
            raise DynamoRequestError(
                422,
                f"Failed to deserialize the JSON body: `{name}` holds {str(v)[:40]}, "
                f"not an integer in [{low}, {high})",
            )
    return values


class _TokenQuery(msgspec.Struct):
    token_ids: list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]]
    model_name: str
    routing_group: str = DEFAULT_ROUTING_GROUP
    lora_name: str | None = None
    cache_salt: str | None = None


class _HashQuery(msgspec.Struct):
    # Dynamo takes them as i64; their unsigned reading (what compute_block_hash_for_seq
    # returns) is the same 8 bytes and is taken too.
    block_hashes: list[int]
    model_name: str
    routing_group: str = DEFAULT_ROUTING_GROUP
    cache_salt: str | None = None


_DECODERS: dict[bool, msgspec.json.Decoder[_TokenQuery | _HashQuery]] = {
    False: msgspec.json.Decoder(_TokenQuery),
    True: msgspec.json.Decoder(_HashQuery),
}


def parse_query(raw: bytes, by_hash: bool) -> Query:
    """A /query or /query_by_hash body (typed and bounded by msgspec, in C: a prompt's
    tokens are checked without a Python loop over them). A /query body the compiled core
    reads (rust/src/dynamo_query.rs: a subset of what msgspec takes, the same values) keeps
    its token ids packed, never made Python ints; what it declines is read here."""
    if not by_hash and _token_query is not None:
        fast = _token_query(raw)
        if fast is not None and len(fast[3]) <= 4 * MAX_TOKENS:
            model, routing_group, lora_name, packed = fast
            return Query(model, routing_group, None, None, lora_name or None, packed)
    try:
        q = _DECODERS[by_hash].decode(raw)
    except msgspec.ValidationError as exc:
        raise DynamoRequestError(422, f"Failed to deserialize the JSON body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DynamoRequestError(400, f"Failed to parse the request body as JSON: {exc}") from None
    except RecursionError:
        raise DynamoRequestError(
            400, "Failed to parse the request body as JSON: nested too deeply"
        ) from None
    if q.cache_salt is not None:
        raise DynamoRequestError(400, SALTED_HASHES if by_hash else SALT_UNKNOWN)
    if isinstance(q, _HashQuery):
        hashes = q.block_hashes
        if len(hashes) > MAX_TOKENS:
            raise DynamoRequestError(413, f"`block_hashes` has over {MAX_TOKENS} items")
        if hashes and (min(hashes) < -(1 << 63) or max(hashes) >= 1 << 64):
            raise DynamoRequestError(
                422,
                "Failed to deserialize the JSON body: `block_hashes` holds an integer "
                "outside [-2**63, 2**64)",
            )
        return Query(q.model_name, q.routing_group, [h & _U64 for h in q.block_hashes], None, None)
    if len(q.token_ids) > MAX_TOKENS:
        raise DynamoRequestError(413, f"`token_ids` has over {MAX_TOKENS} items")
    return Query(q.model_name, q.routing_group, None, q.token_ids, q.lora_name or None)


def local_hashes(tokens: list[int], block_size: int, lora_name: str | None) -> list[int]:
    seed = dynamo_seed(lora_name)
    if _native_hashes is not None:  # takes Dynamo's u32 token ids as they are
        hashes: list[int] = _native_hashes(tokens, block_size, seed)
        return hashes
    from kvledger.schemas.dynamo import dynamo_block_hashes

    return dynamo_block_hashes(tokens, block_size, lora_name)
