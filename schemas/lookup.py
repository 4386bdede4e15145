"""The lookup API's answers, as the Python API (kvledger.serving.lookup), the HTTP service
(GET /openapi.json) and its client (kvledger.client) all give them. Standard library only,
so the client works from the base install."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Holder:
    """One holder's match: how many leading whole blocks of the prompt it holds, and how
    many tokens (which a partial tail extends past the last whole block)."""

    instance: str
    medium: str
    ownership: str
    matched_blocks: int
    matched_tokens: int
    # live | silent | closed | unknown (as_of for match_at): an annotation of the match, not
    # part of it (holders compare by what they hold).
    source_state: str = field(default="live", compare=False)
    # A router sent the prompt there and the engine's events have not shown the blocks yet
    # (answered for a short window: docs/routers.md, "Provisional holders").
    provisional: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class Residency:
    """One current holder of a block."""

    instance: str
    medium: str
    ownership: str
    locality: str | None
    since: datetime
    refcount: int


@dataclass(frozen=True, slots=True)
class Block:
    """What the index knows of one block hash."""

    model: str
    group_idx: int
    block_hash: bytes
    parent_hash: bytes | None
    token_start: int | None
    token_end: int | None
    block_size: int
    partial: bool
    lora_name: str | None
    first_seen: datetime
    last_seen: datetime
    holders: tuple[Residency, ...]


@dataclass(frozen=True, slots=True)
class Ranked:
    instance: str
    score: float
    tokens_by_tier: dict[str, int]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's load as its relay last read it from the engine's metrics: the requests it
    was running and had queued, at ``at`` (the log time of the heartbeat that said so)."""

    instance: str
    running: int | None
    waiting: int | None
    at: datetime
