"""The payloads the tracker (:mod:`.tracker`) snapshots for a chunk when the scheduler
stores or looks it up: a full chunk's blocks, or a partial recurrent tail's, with its
parent, tokens, LoRA and lookahead tokens, each checked against the request. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvledger.producer.tracker_inputs import (
    GroupConfigLike,
    Medium,
    OffloadingEventGroupSpec,
    RequestLike,
    TrackerInputError,
    resolve_block_hashes,
)

# The tracker is primary-CPU by construction: the primary tier's residency.
Residency = tuple[Medium, str | None]
PRIMARY_RESIDENCY: Residency = (Medium.CPU, None)
NO_SPEC = OffloadingEventGroupSpec(None, None)


@dataclass(slots=True)
class ChunkPayload:
    """The BlockStored payload of one offload key, kept until its last residency goes."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    token_start: int | None
    block_size: int
    partial: bool
    lora_id: int | None
    lora_name: str | None
    group_idx: int
    spec: OffloadingEventGroupSpec
    residencies: set[Residency]
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(slots=True)
class RequestState:
    """What a complete chunk's store needs of its request (0.34's request-context path);
    the lists are the request's own, so they grow with it."""

    block_hashes: Sequence[bytes | None]
    all_token_ids: Sequence[int]
    lora_request: Any
    resumable: bool
    kv_transfer_params: dict[str, Any] | None
    group_configs: dict[int, GroupConfigLike]


def full_chunk_payload(
    req: RequestLike, cfg: GroupConfigLike, chunk_idx: int, lookahead: int
) -> ChunkPayload:
    """A full chunk's payload (``record_store`` / ``record_lookup``)."""
    hashes_per_chunk = cfg.hashes_per_chunk
    tokens_per_hash = tokens_per_hash_of(cfg)
    if chunk_idx < 0:
        raise TrackerInputError(f"chunk index {chunk_idx} is negative")
    first = chunk_idx * hashes_per_chunk
    last = first + hashes_per_chunk
    raw_hashes = req.block_hashes
    if last > len(raw_hashes):
        raise TrackerInputError(
            f"chunk {chunk_idx} needs hashes [{first}, {last}) but the request has "
            f"{len(raw_hashes)}"
        )
    resolved = resolve_block_hashes(raw_hashes[first:last], tokens_per_hash, cfg.tokens_per_block)
    if cfg.tokens_per_block <= 0 or cfg.tokens_per_chunk % cfg.tokens_per_block:
        raise TrackerInputError(
            f"group {cfg.group_idx}: chunk of {cfg.tokens_per_chunk} tokens is not a whole "
            f"number of {cfg.tokens_per_block}-token blocks"
        )
    block_hashes = present(resolved, f"chunk {chunk_idx}")
    parent = parent_of(raw_hashes, first)
    tok_start = chunk_idx * cfg.tokens_per_chunk
    tok_end = tok_start + cfg.tokens_per_chunk
    tokens = req.all_token_ids
    if tok_end > len(tokens):
        raise TrackerInputError(
            f"chunk {chunk_idx} covers tokens [{tok_start}, {tok_end}) but the request has "
            f"{len(tokens)}"
        )
    lora_id, lora_name = lora_of(req)
    return ChunkPayload(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens[tok_start:tok_end]),
        token_start=tok_start,
        block_size=cfg.tokens_per_block,
        partial=False,
        lora_id=lora_id,
        lora_name=lora_name,
        group_idx=cfg.group_idx,
        spec=cfg.kv_event_group_spec,
        residencies={PRIMARY_RESIDENCY},
        lookahead_token_ids=lookahead_tokens(
            tokens, tok_start, tok_end, cfg.tokens_per_block, lookahead
        ),
    )


def lookahead_tokens(
    tokens: Sequence[int], start: int, end: int, block_size: int, lookahead: int
) -> tuple[tuple[int, ...], ...] | None:
    """The ``lookahead`` tokens after each block ending in (start, end], or None."""
    if not lookahead:
        return None
    if end + lookahead > len(tokens):
        raise TrackerInputError(
            f"lookahead of {lookahead} tokens after token {end} is past the "
            f"request's {len(tokens)} tokens"
        )
    return tuple(
        tuple(tokens[i : i + lookahead]) for i in range(start + block_size, end + 1, block_size)
    )


def partial_tail_payload(
    req: RequestLike, cfg: GroupConfigLike, boundary_tokens: int, lookahead: int
) -> ChunkPayload:
    """A partial recurrent tail's payload, up to ``boundary_tokens``."""
    tokens_per_hash = tokens_per_hash_of(cfg)
    if boundary_tokens <= 0:
        raise TrackerInputError(f"partial tail boundary {boundary_tokens} must be positive")
    if boundary_tokens % tokens_per_hash:
        raise TrackerInputError(
            f"partial tail boundary {boundary_tokens} is not on a {tokens_per_hash}-token hash edge"
        )
    # Minus one: a boundary exactly on a block edge belongs to the block before it.
    chunk_start = ((boundary_tokens - 1) // cfg.tokens_per_chunk) * cfg.tokens_per_chunk
    first = chunk_start // tokens_per_hash
    last = boundary_tokens // tokens_per_hash
    raw_hashes = req.block_hashes
    if last > len(raw_hashes):
        raise TrackerInputError(
            f"partial tail up to token {boundary_tokens} needs {last} hashes but the "
            f"request has {len(raw_hashes)}"
        )
    tokens = req.all_token_ids
    if boundary_tokens > len(tokens):
        raise TrackerInputError(
            f"partial tail boundary {boundary_tokens} is past the request's {len(tokens)} tokens"
        )
    block_hashes = present(raw_hashes[first:last], f"tail at {boundary_tokens}")
    lora_id, lora_name = lora_of(req)
    return ChunkPayload(
        block_hashes=block_hashes,
        parent_block_hash=parent_of(raw_hashes, first),
        token_ids=tuple(tokens[chunk_start:boundary_tokens]),
        token_start=chunk_start,
        block_size=tokens_per_hash,
        partial=True,
        lora_id=lora_id,
        lora_name=lora_name,
        group_idx=cfg.group_idx,
        spec=cfg.kv_event_group_spec,
        residencies={PRIMARY_RESIDENCY},
        lookahead_token_ids=lookahead_tokens(
            tokens, chunk_start, boundary_tokens, tokens_per_hash, lookahead
        ),
    )


def parent_of(raw_hashes: Sequence[bytes | None], first: int) -> bytes | None:
    if first == 0:
        return None
    parent = raw_hashes[first - 1]
    if parent is None:
        raise TrackerInputError(f"the hash before index {first} (the parent) is missing")
    return bytes(parent)


def tokens_per_hash_of(cfg: GroupConfigLike) -> int:
    if cfg.hashes_per_chunk <= 0 or cfg.tokens_per_chunk % cfg.hashes_per_chunk:
        raise TrackerInputError(
            f"group {cfg.group_idx}: {cfg.tokens_per_chunk} tokens per chunk do not split "
            f"into {cfg.hashes_per_chunk} hashes"
        )
    return cfg.tokens_per_chunk // cfg.hashes_per_chunk


def present(hashes: Sequence[bytes | None], what: str) -> tuple[bytes, ...]:
    if not hashes:
        raise TrackerInputError(f"{what}: no hashes")
    out = []
    for i, h in enumerate(hashes):
        if h is None:
            raise TrackerInputError(f"{what}: hash {i} is missing")
        out.append(bytes(h))
    return tuple(out)


def lora_of(req: Any) -> tuple[int | None, str | None]:
    lora = req.lora_request
    if lora is None:
        return None, None
    return int(lora.adapter_id), str(lora.name)
