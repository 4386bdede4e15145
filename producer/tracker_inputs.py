"""What vLLM hands the offloading events tracker (:mod:`.tracker`): the tiers, a group's
event spec and offload config, the duck-typed request and group config, the raw
``OffloadingEvent``, a request's context, and offload keys (a chunk's last raw hash and its
group). Names and fields are vLLM 0.33.0's and 0.34.0's. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Protocol

OffloadKey = bytes


class Medium(Enum):
    """Tier of an offloaded chunk. The tracker's tiers are CPU and STORAGE; events know GPU."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(Enum):
    """Where a tier's storage sits relative to the publishing instance."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class OffloadingEventGroupSpec(NamedTuple):
    """Static classification of a KV-cache group, copied onto its events."""

    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


class GroupOffloadConfig(NamedTuple):
    """Offload geometry of one KV-cache group (vLLM's scheduler-side config)."""

    group_idx: int
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    kv_event_group_spec: OffloadingEventGroupSpec
    # None means full attention; set for sliding-window, chunked-local and Mamba groups.
    sliding_window_size_in_chunks: int | None = None

    @property
    def tokens_per_hash(self) -> int:
        return self.tokens_per_chunk // self.hashes_per_chunk


class LoraRequestLike(Protocol):
    @property
    def adapter_id(self) -> int: ...
    @property
    def name(self) -> str: ...


class RequestLike(Protocol):
    @property
    def block_hashes(self) -> Sequence[bytes | None]: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def lora_request(self) -> LoraRequestLike | None: ...


class GroupConfigLike(Protocol):
    @property
    def group_idx(self) -> int: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def tokens_per_chunk(self) -> int: ...
    @property
    def hashes_per_chunk(self) -> int: ...
    @property
    def kv_event_group_spec(self) -> OffloadingEventGroupSpec: ...
    @property
    def sliding_window_size_in_chunks(self) -> int | None: ...


@dataclass(slots=True)
class OffloadingEvent:
    """A raw event of the offloading manager: keys stored on, or removed from, a tier."""

    keys: list[OffloadKey]
    medium: Medium
    # True if the keys were removed, False if stored.
    removed: bool
    locality: Locality | None = None
    # Secondary tier that generated the event, or None for the primary tier.
    ownership: str | None = None
    # A stored event whose tier will report the removal: it adds a residency.
    removal_expected: bool = False
    # A failed allocation: release metadata without announcing a public eviction.
    metadata_only: bool = False
    # 0.34: the originating request's context (see OffloadingEventsTracker.on_new_request),
    # from which a complete chunk's store is described when nothing was recorded for it.
    req_context: ReqContextLike | None = None


class ReqContextLike(Protocol):
    """vLLM 0.34's per-request offloading context (``ReqContext``): typed scratch state and
    the end-token position the scheduler recorded for each offload key of the request."""

    def set_state(self, val: Any) -> None: ...

    def get_state(self, cls: type[Any]) -> Any: ...

    def get_offload_key_position(self, key: OffloadKey) -> int | None: ...


class RequestContext:
    """A :class:`ReqContextLike` for engines and simulations without vLLM's own."""

    __slots__ = ("_positions", "_state")

    def __init__(self) -> None:
        self._state: dict[type, Any] = {}
        self._positions: dict[OffloadKey, int] = {}

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[Any]) -> Any:
        return self._state.get(cls)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._positions.get(key)


class TrackerInputError(ValueError):
    """A record_* call whose arguments do not describe a chunk of the request."""


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """The offload key of a chunk: its last raw hash, then the group as 4 big-endian bytes."""
    return bytes(block_hash) + group_idx.to_bytes(4, "big", signed=False)


def offload_key_hash(key: OffloadKey) -> bytes:
    """The block hash inside an offload key."""
    return key[:-4]


def offload_key_group(key: OffloadKey) -> int:
    """The KV-cache group index inside an offload key."""
    return int.from_bytes(key[-4:], "big", signed=False)


def resolve_block_hashes(
    raw_hashes: Sequence[bytes | None], tokens_per_hash: int, tokens_per_block: int
) -> list[bytes | None]:
    """View hashes computed every ``tokens_per_hash`` tokens at ``tokens_per_block`` granularity.

    Each raw hash chains over its whole prefix, so the last raw hash inside a block
    fingerprints that block: with 4-token hashes and 256-token blocks the block hashes are the
    raw hashes at indices 63, 127, ...
    """
    if tokens_per_hash <= 0 or tokens_per_block <= 0:
        raise TrackerInputError(
            f"token granularities must be positive (hash {tokens_per_hash}, "
            f"block {tokens_per_block})"
        )
    if tokens_per_block == tokens_per_hash:
        return list(raw_hashes)
    if tokens_per_block % tokens_per_hash:
        raise TrackerInputError(
            f"block size {tokens_per_block} is not a multiple of the hash size {tokens_per_hash}"
        )
    scale = tokens_per_block // tokens_per_hash
    return [raw_hashes[i] for i in range(scale - 1, len(raw_hashes), scale)]
