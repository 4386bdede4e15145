"""Self-describing KV cache events for offloaded chunks, with vLLM 0.33.0's semantics.

An offloading manager knows a chunk only by its offload key (the chunk's last raw block hash
followed by the KV-cache group index as 4 big-endian bytes), so its raw ``OffloadingEvent``s
carry no tokens, parent or block size. The scheduler still holds the request when it stores or
looks up a chunk; :class:`OffloadingEventsTracker` snapshots the chunk's full ``BlockStored``
payload at that moment and keeps it until the last residency of the chunk is removed, so that
both the store and the eviction can be published with every constituent block hash.

Method names and argument order are vLLM's, so an engine integration is a drop-in. Inputs are
duck-typed: a request has ``block_hashes`` (bytes at ``tokens_per_hash`` granularity),
``all_token_ids`` and ``lora_request`` (None, or with ``adapter_id`` and ``name``); a group
config is a :class:`GroupOffloadConfig` or anything with the same attributes.

Pure: no Kafka, no I/O. Hashes stay bytes exactly as given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvledger.producer.tracker_inputs import (
    GroupConfigLike,
    GroupOffloadConfig,
    Locality,
    LoraRequestLike,
    Medium,
    OffloadingEvent,
    OffloadingEventGroupSpec,
    OffloadKey,
    ReqContextLike,
    RequestContext,
    RequestLike,
    TrackerInputError,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
    resolve_block_hashes,
)
from kvledger.producer.tracker_payloads import (
    NO_SPEC,
    PRIMARY_RESIDENCY,
    ChunkPayload,
    RequestState,
    Residency,
    full_chunk_payload,
    partial_tail_payload,
)
from kvledger.schemas.events import RECURRENT_KINDS, BlockRemoved, BlockStored, GroupSpec

__all__ = [
    "RULES",
    "GroupConfigLike",
    "GroupOffloadConfig",
    "Locality",
    "LoraRequestLike",
    "Medium",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingEventGroupSpec",
    "OffloadingEventsTracker",
    "ReqContextLike",
    "RequestContext",
    "RequestLike",
    "Residency",
    "TrackerInputError",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
    "resolve_block_hashes",
    "rules_for",
]

logger = logging.getLogger(__name__)
# Placeholder warnings are expected for some groups: say each once per process, as vLLM does.
_warned: set[str] = set()


def _warn_once(kind: str, message: str) -> None:
    """Say once, at DEBUG, a thing the tracker does that is expected (vLLM warns it once; a
    warning, or a line on every run, for expected behaviour only alarms: `simulate`
    printed two on every run, then two INFO lines)."""
    if kind not in _warned:
        _warned.add(kind)
        logger.debug(message)


# The vLLM releases whose tracker rules this one follows, by minor version.
RULES = ("0.33", "0.34")


def rules_for(vllm_version: str) -> str:
    """The tracker rules of a vLLM release (``0.34.0`` -> ``0.34``); an engine version
    whose rules the tracker does not know raises ``ValueError`` saying which it knows."""
    parts = vllm_version.split(".")
    rules = ".".join(parts[:2])
    if len(parts) < 2 or rules not in RULES:
        raise ValueError(
            f"vLLM {vllm_version!r}: the offloading events tracker follows the rules of "
            f"vLLM {' and '.join(RULES)} only"
        )
    return rules


class OffloadingEventsTracker:
    """Tracks offloaded chunks' event payloads from store to eviction, by the rules of the
    vLLM release it serves (``vllm_version``; 0.33.0's by default).

    The scheduler calls :meth:`record_store` when it schedules a chunk's store and
    :meth:`record_lookup` for primary-tier hits, while it still has the request; the
    partial-tail variants do the same for recurrent tails that end before their block is full.
    :meth:`take_events` then turns each batch of the manager's raw events into ``BlockStored``
    / ``BlockRemoved``. Payloads live until the final residency removal or :meth:`reset`.

    ``enabled`` stands for vLLM's ``enable_kv_cache_events`` and ``self_describing_kv_events``
    both on; disabled, every event is a legacy placeholder. ``group_specs`` classify groups
    for placeholders and survive :meth:`reset`.

    Under 0.34's rules a recurrent group (``mamba``) is recorded too, and each of its chunks
    is announced as a *state checkpoint*: the chunk's last hash only, chained to the hash
    before it, its block size, no tokens and no position (the state is valid there and
    nowhere else in the chunk). Windowed attention groups keep the placeholder under both.

    0.34 also describes a complete chunk's store from its request's context
    (:meth:`on_new_request`, then ``OffloadingEvent.req_context``) when nothing was recorded
    for it, and can carry ``num_hash_lookahead_tokens`` tokens after each block.

    Not thread-safe: one scheduler thread drives it.
    """

    def __init__(
        self,
        enabled: bool = True,
        group_specs: dict[int, OffloadingEventGroupSpec] | None = None,
        vllm_version: str = "0.33.0",
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        self.rules = rules_for(vllm_version)
        if num_hash_lookahead_tokens < 0 or (num_hash_lookahead_tokens and self.rules == "0.33"):
            raise ValueError(
                f"num_hash_lookahead_tokens {num_hash_lookahead_tokens}: a count from 0, and "
                "only under vLLM 0.34's rules (0.33's events carry no lookahead tokens)"
            )
        self.lookahead = num_hash_lookahead_tokens
        self.enabled = enabled
        self._group_specs: dict[int, OffloadingEventGroupSpec] = dict(group_specs or {})
        self._payloads: dict[OffloadKey, ChunkPayload] = {}

    # ------------------------------------------------------------------ recording
    def _records(self, group_config: GroupConfigLike) -> bool:
        """Sliding-window and chunked-local groups keep placeholder payloads, and so do
        Mamba groups under 0.33's rules."""
        if not self.enabled:
            return False
        return group_config.sliding_window_size_in_chunks is None or self._recurrent(group_config)

    def _recurrent(self, cfg: GroupConfigLike) -> bool:
        """Whether ``cfg``'s chunks are state checkpoints (0.34's recurrent groups)."""
        kind = cfg.kv_event_group_spec.kv_cache_spec_kind
        return self.rules != "0.33" and kind in RECURRENT_KINDS

    def _checkpoint(self, cfg: GroupConfigLike, payload: ChunkPayload) -> ChunkPayload:
        """``payload`` reduced to the state checkpoint it holds, in a recurrent group."""
        if not self._recurrent(cfg):
            return payload
        if len(payload.block_hashes) > 1:
            payload.parent_block_hash = payload.block_hashes[-2]
        payload.block_hashes = payload.block_hashes[-1:]
        payload.token_ids = ()
        payload.token_start = None
        return payload

    def on_new_request(
        self,
        req_context: ReqContextLike,
        request: RequestLike,
        group_configs: Iterable[GroupConfigLike],
    ) -> None:
        """0.34: keep in ``req_context`` what a complete chunk's store of ``request`` needs, so
        that a store event carrying the context is described without a recorded payload. A
        resumable request, or one whose prefill side was truncated, is never described so."""
        if not self.enabled or self.rules == "0.33":
            return
        req_context.set_state(
            RequestState(
                block_hashes=request.block_hashes,
                all_token_ids=request.all_token_ids,
                lora_request=request.lora_request,
                resumable=bool(getattr(request, "resumable", False)),
                kv_transfer_params=getattr(request, "kv_transfer_params", None),
                group_configs={cfg.group_idx: cfg for cfg in group_configs},
            )
        )

    def _from_context(self, req_context: ReqContextLike, key: OffloadKey) -> ChunkPayload | None:
        """A complete chunk's payload from its request's context; None when the context does
        not describe ``key`` (no state, an unknown or windowed group, no chunk-aligned end)."""
        state = req_context.get_state(RequestState)
        if state is None:
            return None
        cfg = state.group_configs.get(offload_key_group(key))
        end = req_context.get_offload_key_position(key)
        if cfg is None or not self._records(cfg) or end is None or end % cfg.tokens_per_chunk:
            return None
        if state.resumable or (state.kv_transfer_params or {}).get("_p_side_truncated"):
            return None
        payload = full_chunk_payload(state, cfg, end // cfg.tokens_per_chunk - 1, self.lookahead)
        return self._checkpoint(cfg, payload)

    def record_store(
        self,
        req: RequestLike,
        group_config: GroupConfigLike,
        chunk_idx: int,
        offload_key: OffloadKey,
    ) -> None:
        """Snapshot the payload of a full chunk being stored; merges residencies on re-store."""
        if not self._records(group_config):
            return
        payload = full_chunk_payload(req, group_config, chunk_idx, self.lookahead)
        self._put_merging(offload_key, self._checkpoint(group_config, payload))

    def record_lookup(
        self,
        req: RequestLike,
        group_config: GroupConfigLike,
        chunk_idx: int,
        offload_key: OffloadKey,
    ) -> None:
        """Backfill a primary-tier hit's payload (never overwriting); register (CPU, None)."""
        if not self._records(group_config):
            return
        payload = self._payloads.get(offload_key)
        if payload is None:
            payload = full_chunk_payload(req, group_config, chunk_idx, self.lookahead)
            payload = self._payloads[offload_key] = self._checkpoint(group_config, payload)
        payload.residencies.add(PRIMARY_RESIDENCY)

    def record_partial_store(
        self,
        req: RequestLike,
        group_config: GroupConfigLike,
        boundary_tokens: int,
        offload_key: OffloadKey,
    ) -> None:
        """Snapshot a partial recurrent tail ending at ``boundary_tokens`` (a hash edge)."""
        if not self._records(group_config):
            return
        payload = partial_tail_payload(req, group_config, boundary_tokens, self.lookahead)
        self._put_merging(offload_key, self._checkpoint(group_config, payload))

    def record_partial_lookup(
        self,
        req: RequestLike,
        group_config: GroupConfigLike,
        boundary_tokens: int,
        offload_key: OffloadKey,
    ) -> None:
        """Backfill a partial tail's payload on a lookup hit, only when none is recorded."""
        if not self._records(group_config):
            return
        if offload_key not in self._payloads:
            payload = partial_tail_payload(req, group_config, boundary_tokens, self.lookahead)
            self._payloads[offload_key] = self._checkpoint(group_config, payload)

    def set_group_spec(self, group_idx: int, spec: OffloadingEventGroupSpec) -> None:
        """Classify a group for placeholders (kept across :meth:`reset`)."""
        self._group_specs[group_idx] = spec

    def reset(self) -> None:
        """Drop every payload (stale after a manager cache reset); group specs stay."""
        self._payloads.clear()

    def tracked_keys(self) -> int:
        """How many offload keys have a payload (for tests and metrics)."""
        return len(self._payloads)

    def residencies(self, offload_key: OffloadKey) -> frozenset[Residency]:
        """The (medium, ownership) pairs recorded for a key; empty when untracked."""
        payload = self._payloads.get(offload_key)
        return frozenset(payload.residencies) if payload else frozenset()

    # ------------------------------------------------------------------ translation
    def take_events(self, events: Iterable[OffloadingEvent]) -> list[BlockStored | BlockRemoved]:
        """Translate one batch of the manager's raw events into self-describing events.

        Payloads whose residencies all went are dropped after the whole batch: a primary
        removal may precede a secondary store of the same key in one batch.
        """
        out: list[BlockStored | BlockRemoved] = []
        removed_keys: set[OffloadKey] = set()
        for event in events:
            if event.removed:
                if self.enabled:
                    removed_keys.update(event.keys)
                out.extend(self._removed(event))
            else:
                out.extend(self._stored(event))
        for key in removed_keys:
            payload = self._payloads.get(key)
            if payload is not None and not payload.residencies:
                del self._payloads[key]
        return out

    def _stored(self, event: OffloadingEvent) -> Iterable[BlockStored]:
        locality = event.locality.value if event.locality is not None else None
        medium = event.medium.value
        for key in event.keys:
            payload = self._payloads.get(key)
            if payload is None and self.enabled and event.req_context is not None:
                payload = self._from_context(event.req_context, key)
                if payload is not None and event.removal_expected:
                    # Kept, for removals to expand; its residencies are this store's alone.
                    payload.residencies.clear()
                    self._payloads[key] = payload
            if payload is None:
                if self.enabled:
                    _warn_once(
                        "store",
                        "no payload for an offload key being stored: emitting a placeholder "
                        "(expected for non-full-attention groups and unobserved promotions)",
                    )
                yield self._placeholder(key, medium, locality, event.ownership)
                continue
            if event.removal_expected:
                payload.residencies.add((event.medium, event.ownership))
            yield BlockStored(
                block_hashes=payload.block_hashes,
                parent_block_hash=payload.parent_block_hash,
                token_ids=payload.token_ids,
                block_size=payload.block_size,
                lora_id=payload.lora_id,
                medium=medium,
                lora_name=payload.lora_name,
                extra_keys=None,
                group_idx=payload.group_idx,
                kv_cache_spec_kind=payload.spec.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=payload.spec.kv_cache_spec_sliding_window,
                locality=locality,
                ownership=event.ownership,
                token_start=payload.token_start,
                partial=payload.partial,
                lookahead_token_ids=payload.lookahead_token_ids,
            )

    def _removed(self, event: OffloadingEvent) -> Iterable[BlockRemoved]:
        locality = event.locality.value if event.locality is not None else None
        residency: Residency = (event.medium, event.ownership)
        by_group: dict[int, list[bytes]] = {}
        for key in event.keys:
            payload = self._payloads.get(key)
            if event.metadata_only:
                if payload is not None:
                    payload.residencies.discard(residency)
                continue
            if payload is not None:
                by_group.setdefault(payload.group_idx, []).extend(payload.block_hashes)
                payload.residencies.discard(residency)
            else:
                if self.enabled:
                    _warn_once(
                        "remove",
                        "no payload for an offload key being removed: emitting a placeholder "
                        "removal (expected when its store was a placeholder)",
                    )
                by_group.setdefault(offload_key_group(key), []).append(offload_key_hash(key))
        for group_idx, hashes in by_group.items():
            yield BlockRemoved(
                block_hashes=tuple(hashes),
                medium=event.medium.value,
                group_idx=group_idx,
                locality=locality,
                ownership=event.ownership,
            )

    def _placeholder(
        self, key: OffloadKey, medium: str, locality: str | None, ownership: str | None
    ) -> BlockStored:
        group_idx = offload_key_group(key)
        spec = self._group_specs.get(group_idx, NO_SPEC) if self.enabled else NO_SPEC
        return BlockStored(
            block_hashes=(offload_key_hash(key),),
            parent_block_hash=None,
            token_ids=(),
            block_size=0,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group_idx,
            kv_cache_spec_kind=spec.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=spec.kv_cache_spec_sliding_window,
            locality=locality,
            ownership=ownership,
        )

    # ------------------------------------------------------------------ payloads
    def _put_merging(self, key: OffloadKey, payload: ChunkPayload) -> None:
        existing = self._payloads.get(key)
        if existing is not None:
            payload.residencies.update(existing.residencies)
        self._payloads[key] = payload


def group_announcement(model: str, cfg: GroupConfigLike) -> GroupSpec:
    """The GroupSpec a producer announces for a group config (block and hash sizes, kind)."""
    spec = cfg.kv_event_group_spec
    return GroupSpec(
        model=model,
        group_idx=cfg.group_idx,
        kind=spec.kv_cache_spec_kind or "unknown",
        block_size=cfg.tokens_per_block,
        hash_block_size=cfg.tokens_per_chunk // cfg.hashes_per_chunk,
        sliding_window=spec.kv_cache_spec_sliding_window,
    )
