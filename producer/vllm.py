"""The vLLM adapter: vLLM's KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) as
kvledger's events — one mapping for vLLM's objects (an embedded engine's
``KVEventBatch.events``) and for the fields a relay decodes from vLLM's ZMQ stream.

Fields are vLLM's names in vLLM's declaration order (``FIELDS``); a field an engine leaves
at its default (or an older engine lacks) takes the contract's default. Hashes may be
unsigned 64-bit ints (vLLM's default wire form) or bytes. Extra keys are carried per block as
canonical JSON text. vLLM events say nothing of a block's position or of partial tails: the
publisher infers ``partial`` from the group's spec (:func:`fit_to_spec`), the consumer the
position from the parent's row.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

try:  # vLLM brings msgspec; kvledger's base install (an embedded engine's) does not need it
    from msgspec import ValidationError as _ValidationError
    from msgspec import convert as _convert
except ImportError:  # pragma: no cover - exercised by the base-install test
    _convert = None  # type: ignore[assignment]

from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.events import (
    DEFAULT_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupSpec,
    KVEvent,
)
from kvledger.schemas.hashing import int_to_hash_bytes

# vLLM 0.33.0's fields per event type, in declaration order (positional encodings follow it).
FIELDS: Mapping[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
# Fields without a default: every engine sends them.
REQUIRED: Mapping[str, int] = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}
# kvledger's extensions an engine that knows them may set on its objects.
EXTENSIONS = ("token_start", "partial")
_MAX_U64 = 2**64 - 1
_INT, _BYTES = frozenset({int}), frozenset({bytes})
_INT_TUPLE = tuple[int, ...]
_ABSENT = object()
_KIND_OF: dict[type, str] = {}  # classes read as vLLM's events under another name


class VllmEventError(KvledgerError, ValueError):
    """A vLLM event that cannot be read (missing field, wrong type)."""


def register_kind(cls: type, kind: str) -> None:
    """Read instances of ``cls`` as vLLM's ``kind`` events (a decoder's own types)."""
    _KIND_OF[cls] = kind


def kind_of(event: object) -> str:
    """The vLLM event type an object is: its class's name, or the name it was registered as."""
    return _KIND_OF.get(type(event)) or type(event).__name__


def from_vllm_event(event: Any) -> KVEvent:
    """Map one vLLM KV cache event object (msgspec struct, dataclass, anything with vLLM's
    attribute names) to ours."""
    kind = kind_of(event)
    names = FIELDS.get(kind)
    if names is None:
        raise TypeError(f"not a vLLM KV cache event: {kind}")
    fields = {
        n: v for n in (*names, *EXTENSIONS) if (v := getattr(event, n, _ABSENT)) is not _ABSENT
    }
    return from_vllm_fields(kind, fields)


def from_vllm_fields(kind: str, fields: Mapping[str, Any]) -> KVEvent:
    """Map one event given as its type name and fields (absent fields: their defaults)."""
    names = FIELDS.get(kind)
    if names is None:
        raise VllmEventError(f"unknown vLLM event type {kind!r}")
    missing = [n for n in names[: REQUIRED[kind]] if n not in fields]
    if missing and kind == "BlockStored" and set(missing) <= {"lora_id", "medium", "lora_name"}:
        missing = []  # older engines predate these three
    if missing:
        raise VllmEventError(f"{kind} lacks {', '.join(missing)}")
    get = fields.get
    try:
        if kind == "BlockStored":
            parent = get("parent_block_hash")
            return BlockStored(
                block_hashes=hash_tuple(fields["block_hashes"]),
                parent_block_hash=hash_bytes(parent) if parent is not None else None,
                token_ids=_ints(fields["token_ids"]),
                block_size=_int(fields["block_size"]),
                lora_id=_opt_int(get("lora_id")),
                medium=_opt_str(get("medium")),
                lora_name=_opt_str(get("lora_name")),
                extra_keys=extra_keys_json(without_lora(get("extra_keys"), get("lora_name"))),
                group_idx=_opt_int(get("group_idx")),
                kv_cache_spec_kind=_opt_str(get("kv_cache_spec_kind")),
                kv_cache_spec_sliding_window=_opt_int(get("kv_cache_spec_sliding_window")),
                locality=_opt_str(get("locality")),
                ownership=_opt_str(get("ownership")),
                token_start=_opt_int(get("token_start")),
                partial=bool(get("partial", False)),
                session_id=_opt_str(get("session_id")),
                lookahead_token_ids=_lookahead(get("lookahead_token_ids")),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                block_hashes=hash_tuple(fields["block_hashes"]),
                medium=_opt_str(get("medium")),
                group_idx=_opt_int(get("group_idx")),
                locality=_opt_str(get("locality")),
                ownership=_opt_str(get("ownership")),
            )
        return AllBlocksCleared(medium=_opt_str(get("medium")) or DEFAULT_MEDIUM)
    except VllmEventError:
        raise
    except (TypeError, ValueError) as exc:
        raise VllmEventError(f"{kind}: {exc}") from exc


def fit_to_spec(event: KVEvent, spec: GroupSpec | None) -> KVEvent:
    """vLLM's partial recurrent tails carry no ``partial`` flag: their block_size is the
    group's hash size. Such an event is marked partial when the group's spec says so (a
    block size that fits neither is left as it is, for the consumer to reject)."""
    if (
        isinstance(event, BlockStored)
        and spec is not None
        and not event.partial
        and event.block_size
        and event.block_size == spec.hash_block_size != spec.block_size
    ):
        return dataclasses.replace(event, partial=True)
    return event


def hash_bytes(value: object) -> bytes:
    """A vLLM block hash (unsigned 64-bit int, or bytes) as bytes."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= _MAX_U64:
            raise VllmEventError(f"an int block hash must be unsigned 64-bit, got {value}")
        return value.to_bytes(8, "big")
    raise TypeError(f"a block hash must be int or bytes, got {type(value).__name__}")


def signed_hash_bytes(value: object) -> bytes:
    """A block hash an engine publishes as a 64-bit int of either sign (SGLang's signed
    int64, TensorRT-LLM's size_t): the same 8 bytes either way (-1 is 2**64 - 1)."""
    if type(value) is not int or not -(1 << 63) <= value <= _MAX_U64:
        raise VllmEventError(f"a block hash must be a 64-bit int, got {str(value)[:40]}")
    return int_to_hash_bytes(value)


def hash_tuple(values: object) -> tuple[bytes, ...]:
    """A list of vLLM block hashes as bytes (int hashes checked at C speed)."""
    if not isinstance(values, list | tuple):
        raise TypeError(f"block_hashes must be a list, got {type(values).__name__}")
    kinds = set(map(type, values))
    if kinds == _INT and min(values) >= 0 and max(values) <= _MAX_U64:  # vLLM's int hashes
        return tuple([h.to_bytes(8, "big") for h in values])
    if kinds == _BYTES:
        return tuple(values)
    return tuple(hash_bytes(h) for h in values)


def _ints(values: Iterable[object]) -> tuple[int, ...]:
    """Token ids as a tuple of ints, checked in C: by msgspec where it is installed (it
    refuses bools too), else by the set of the items' types."""
    if _convert is not None:
        try:
            return _convert(values, _INT_TUPLE)
        except _ValidationError:
            pass
    else:
        out = tuple(values)
        if set(map(type, out)) <= _INT:
            return out  # type: ignore[return-value,unused-ignore]  # every item is an int
        values = out
    return tuple(_int(t) for t in values)  # names the first that is not an int


def _int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"expected an int, got {type(value).__name__}")


def _opt_int(value: object) -> int | None:
    return None if value is None else _int(value)


def _opt_str(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"expected a string, got {type(value).__name__}")


def _lookahead(value: object) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise TypeError("lookahead_token_ids must be a list of lists")
    return tuple(tuple(_int(t) for t in block) for block in value)


def without_lora(extra: object, lora_name: object) -> object:
    """vLLM's extra keys with the LoRA name left out.

    vLLM puts a LoRA request's name first in every block's extra keys (the hash mixes it
    in), and also sends it as the event's ``lora_name``. kvledger keeps it once, in
    ``lora_name``: a LoRA block with no other extra key is then a plain block of its
    adapter, which a token lookup with that ``lora_name`` finds (a cache salt, multimodal
    inputs or prompt embeddings still make a block's extra keys)."""
    if not isinstance(lora_name, str) or not isinstance(extra, list | tuple):
        return extra
    out = [
        (list(e[1:]) or None) if isinstance(e, list | tuple) and e and e[0] == lora_name else e
        for e in extra
    ]
    return None if all(e is None for e in out) else out


def extra_keys_json(extra: object) -> tuple[str | None, ...] | None:
    """Per block: its extra keys as canonical JSON text (None where it has none)."""
    if extra is None:
        return None
    if not isinstance(extra, list | tuple):
        raise TypeError("extra_keys must be a list with one entry per block")
    return tuple(
        None if e is None else json.dumps(e, sort_keys=True, default=_json_default) for e in extra
    )


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return list(value)
    return str(value)
