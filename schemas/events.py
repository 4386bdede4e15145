"""The events kvledger carries, as Python values.

``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` mirror vLLM's KV cache events (same
field names, same order) with two kvledger extensions on ``BlockStored``: ``token_start`` (the
position of the first token, ``None`` when unknown, as for placeholders) and ``partial`` (a
partial recurrent tail, whose ``block_size`` is the hash granularity). ``GroupSpec`` is the
announcement a producer makes for each KV-cache group before any event of that group.

Hashes are ``bytes`` everywhere: the digest, or its last 8 bytes in vLLM's int64 wire form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvledger.schemas.hashing import to_int64_bytes

# vLLM's KV cache spec kinds (a module of their own: the command line reads them).
from kvledger.schemas.kinds import SPEC_KINDS

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)

# The media whose blocks outlive a restart of their engine unless the source says otherwise
# (GroupSpec.surviving_media): GPU and CPU memory die with the process, storage does not.
DEFAULT_SURVIVING_MEDIA = (MEDIUM_STORAGE,)

# Wire defaults, defined once for both sides: vLLM's GPU block pool events predate the
# group_idx and medium fields, so an absent group is group 0 and an absent medium is GPU.
DEFAULT_GROUP_IDX = 0
DEFAULT_MEDIUM = MEDIUM_GPU

LOCALITIES = ("LOCAL", "REMOTE")

# Recurrent state groups (Mamba, linear attention): from vLLM 0.34 their offloaded chunks
# are announced as state checkpoints (see BlockStored.is_state_checkpoint).
RECURRENT_KINDS = frozenset({"mamba"})
MAX_BLOCK_SIZE = 1 << 20  # tokens per block or per hash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks of one KV-cache group became resident on ``medium``.

    ``block_hashes[i]`` covers tokens ``[token_start + i*block_size, +block_size)``; its parent
    is ``block_hashes[i-1]`` (``parent_block_hash`` for ``i == 0``).
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: that block's extra keys as canonical JSON text, or None.
    extra_keys: tuple[str | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    token_start: int | None = None
    partial: bool = False
    # vLLM's request context and hash look-ahead: carried on the wire, not indexed.
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None

    @property
    def is_placeholder(self) -> bool:
        """A legacy payload: one tail hash, no tokens, block_size 0."""
        return self.block_size == 0 and not self.token_ids

    @property
    def is_state_checkpoint(self) -> bool:
        """vLLM 0.34's payload for a recurrent group's offloaded chunk: the state at one
        hash (the chunk's last), chained to the hash before it, a block size and no tokens
        (a consumer aligns it with the attention group's blocks by hash)."""
        return self.block_size > 0 and not self.token_ids


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks of one KV-cache group left ``medium``."""

    block_hashes: tuple[bytes, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the source on ``medium`` is gone (vLLM sends it on a GPU pool reset)."""

    group_idx: int | None = None
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A producer's announcement of one KV-cache group's shape."""

    model: str
    group_idx: int
    kind: str
    block_size: int
    hash_block_size: int
    sliding_window: int | None = None
    # The source's restart policy (None: DEFAULT_SURVIVING_MEDIA); not part of the shape.
    surviving_media: tuple[str, ...] | None = None
    # The source re-announces reused blocks as stores (vLLM's kv_cache_report_mode="full"):
    # a store of a block it already holds on that medium adds no copy. Not part of the shape.
    reports_reuse: bool = False

    def same_shape(self, other: GroupSpec) -> bool:
        """Two specs that describe one group alike (whatever model or index they name)."""
        return (
            self.kind == other.kind
            and self.block_size == other.block_size
            and self.hash_block_size == other.hash_block_size
            and self.sliding_window == other.sliding_window
        )

    def describe(self) -> str:
        return f"{self.kind}/{self.block_size}/{self.hash_block_size}/{self.sliding_window}"

    def shape_problem(self) -> str | None:
        """Why no group can have this shape (an unknown kind, sizes out of range or not
        multiples), or None; the consumer refuses such an announcement with this reason."""
        if self.kind not in SPEC_KINDS:
            return f"unknown spec kind {self.kind!r} (known: {', '.join(sorted(SPEC_KINDS))})"
        sizes = (self.block_size, self.hash_block_size)
        if not all(0 < size <= MAX_BLOCK_SIZE for size in sizes):
            return (
                f"block sizes must be positive (block {self.block_size}, "
                f"hash {self.hash_block_size})"
            )
        if self.block_size % self.hash_block_size:
            return (
                f"block size {self.block_size} is not a multiple of hash size "
                f"{self.hash_block_size}"
            )
        return None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The source is alive; sent while it is idle (``interval_ms``: its cadence). A relay
    that reads its engine's load sends one each interval, busy or not, with the requests
    the engine was running and had queued (None: not read)."""

    group_idx: int | None = None
    interval_ms: int | None = None
    requests_running: int | None = None
    requests_waiting: int | None = None


@dataclass(frozen=True, slots=True)
class Goodbye:
    """The source is shutting down cleanly (for all its groups)."""

    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EventsLost:
    """A relay could not recover engine batches ``first_seq..last_seq`` (the engine no longer
    held them): the source's blocks in this group, every tier and ownership, are unknown."""

    first_seq: int
    last_seq: int
    group_idx: int | None = None


KVEvent = (
    BlockStored | BlockRemoved | AllBlocksCleared | GroupSpec | Heartbeat | Goodbye | EventsLost
)


@dataclass(frozen=True, slots=True)
class Envelope:
    """One Kafka message: who sent the event, where it stands in the sender's stream, and it.

    ``seq`` counts per (source, group) within one ``epoch``; a producer restart starts a new
    epoch (milliseconds since the Unix epoch at start-up) with ``seq`` from 0.
    """

    source: str
    model: str
    dp_rank: int
    epoch: int
    seq: int
    event_time_ms: int
    event: KVEvent
    # The engine's sequence number of the batch the event came in (relayed engines only).
    engine_seq: int | None = None


def group_of(event: KVEvent) -> int:
    """The event's KV-cache group, with the wire default applied."""
    group = event.group_idx
    return group if group is not None else DEFAULT_GROUP_IDX


def medium_of(event: BlockStored | BlockRemoved | AllBlocksCleared) -> str:
    """The event's medium, with the wire default applied."""
    medium = event.medium
    return medium if medium is not None else DEFAULT_MEDIUM


_EIGHT = frozenset({8})


def with_int64_hashes(event: BlockStored | BlockRemoved) -> BlockStored | BlockRemoved:
    """The event with its hashes in vLLM's int64 wire form (each digest's last 8 bytes);
    the event itself when they already are, every other field kept."""
    parent = event.parent_block_hash if isinstance(event, BlockStored) else None
    if (parent is None or len(parent) == 8) and set(map(len, event.block_hashes)) <= _EIGHT:
        return event
    hashes = tuple(to_int64_bytes(h) for h in event.block_hashes)
    if isinstance(event, BlockRemoved):
        return replace(event, block_hashes=hashes)
    return replace(
        event,
        block_hashes=hashes,
        parent_block_hash=to_int64_bytes(parent) if parent is not None else None,
    )
