"""The envelope and its events as the Avro records fastavro reads and writes, and back.

fastavro encodes where the compiled encoder was not built, and decodes messages written with
other schemas (older releases, a registry's); the compiled coder (:mod:`.avro_program`)
works on the types directly. tests/unit/test_avro_program.py checks the two agree.
"""

from __future__ import annotations

from typing import Any

from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventsLost,
    Goodbye,
    GroupSpec,
    Heartbeat,
    KVEvent,
)


def envelope_to_record(env: Envelope) -> dict[str, Any]:
    """The Avro record of an envelope, the union branch named explicitly (tuple notation)."""
    return {
        "source": env.source,
        "model": env.model,
        "dp_rank": env.dp_rank,
        "epoch": env.epoch,
        "seq": env.seq,
        "event_time_ms": env.event_time_ms,
        "event": _event_to_branch(env.event),
        "engine_seq": env.engine_seq,
    }


def _event_to_branch(event: KVEvent) -> tuple[str, dict[str, Any]]:
    if isinstance(event, BlockStored):
        return (
            "kvledger.BlockStored",
            {
                "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_id": event.lora_id,
                "medium": event.medium,
                "lora_name": event.lora_name,
                # A list, not a tuple: fastavro reads tuples as explicit union branches.
                "extra_keys": list(event.extra_keys) if event.extra_keys is not None else None,
                "group_idx": event.group_idx,
                "kv_cache_spec_kind": event.kv_cache_spec_kind,
                "kv_cache_spec_sliding_window": event.kv_cache_spec_sliding_window,
                "locality": event.locality,
                "ownership": event.ownership,
                "token_start": event.token_start,
                "partial": event.partial,
                "session_id": event.session_id,
                "lookahead_token_ids": (
                    [list(t) for t in event.lookahead_token_ids]
                    if event.lookahead_token_ids is not None
                    else None
                ),
            },
        )
    if isinstance(event, BlockRemoved):
        return (
            "kvledger.BlockRemoved",
            {
                "block_hashes": event.block_hashes,
                "medium": event.medium,
                "group_idx": event.group_idx,
                "locality": event.locality,
                "ownership": event.ownership,
            },
        )
    if isinstance(event, AllBlocksCleared):
        return ("kvledger.AllBlocksCleared", {"group_idx": event.group_idx, "medium": event.medium})
    if isinstance(event, GroupSpec):
        return (
            "kvledger.GroupSpec",
            {
                "model": event.model,
                "group_idx": event.group_idx,
                "kind": event.kind,
                "block_size": event.block_size,
                "hash_block_size": event.hash_block_size,
                "sliding_window": event.sliding_window,
                "surviving_media": (
                    list(event.surviving_media) if event.surviving_media is not None else None
                ),
                "reports_reuse": event.reports_reuse,
            },
        )
    if isinstance(event, Heartbeat):
        return (
            "kvledger.Heartbeat",
            {
                "group_idx": event.group_idx,
                "interval_ms": event.interval_ms,
                "requests_running": event.requests_running,
                "requests_waiting": event.requests_waiting,
            },
        )
    if isinstance(event, Goodbye):
        return ("kvledger.Goodbye", {"group_idx": event.group_idx})
    if isinstance(event, EventsLost):
        return (
            "kvledger.EventsLost",
            {
                "group_idx": event.group_idx,
                "first_seq": event.first_seq,
                "last_seq": event.last_seq,
            },
        )
    raise TypeError(f"not a kvledger event: {type(event).__name__}")


def record_to_envelope(record: dict[str, Any]) -> Envelope:
    name, body = record["event"]
    event: KVEvent
    if name == "kvledger.BlockStored":
        extra = body.get("extra_keys")
        event = BlockStored(
            block_hashes=tuple(body["block_hashes"]),
            parent_block_hash=body.get("parent_block_hash"),
            token_ids=tuple(body["token_ids"]),
            block_size=body["block_size"],
            lora_id=body.get("lora_id"),
            medium=body.get("medium"),
            lora_name=body.get("lora_name"),
            extra_keys=tuple(extra) if extra is not None else None,
            group_idx=body.get("group_idx"),
            kv_cache_spec_kind=body.get("kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=body.get("kv_cache_spec_sliding_window"),
            locality=body.get("locality"),
            ownership=body.get("ownership"),
            token_start=body.get("token_start"),
            partial=bool(body.get("partial", False)),
            session_id=body.get("session_id"),
            lookahead_token_ids=(
                tuple(tuple(t) for t in look)
                if (look := body.get("lookahead_token_ids")) is not None
                else None
            ),
        )
    elif name == "kvledger.BlockRemoved":
        event = BlockRemoved(
            block_hashes=tuple(body["block_hashes"]),
            medium=body.get("medium"),
            group_idx=body.get("group_idx"),
            locality=body.get("locality"),
            ownership=body.get("ownership"),
        )
    elif name == "kvledger.AllBlocksCleared":
        event = AllBlocksCleared(group_idx=body.get("group_idx"), medium=body.get("medium"))
    elif name == "kvledger.GroupSpec":
        event = GroupSpec(
            model=body["model"],
            group_idx=body["group_idx"],
            kind=body["kind"],
            block_size=body["block_size"],
            hash_block_size=body["hash_block_size"],
            sliding_window=body.get("sliding_window"),
            surviving_media=tuple(m) if (m := body.get("surviving_media")) is not None else None,
            reports_reuse=body.get("reports_reuse", False),
        )
    elif name == "kvledger.Heartbeat":
        event = Heartbeat(
            group_idx=body.get("group_idx"),
            interval_ms=body.get("interval_ms"),
            requests_running=body.get("requests_running"),
            requests_waiting=body.get("requests_waiting"),
        )
    elif name == "kvledger.Goodbye":
        event = Goodbye(group_idx=body.get("group_idx"))
    elif name == "kvledger.EventsLost":
        event = EventsLost(
            first_seq=body["first_seq"], last_seq=body["last_seq"], group_idx=body.get("group_idx")
        )
    else:
        raise DecodeError("unknown_schema", f"unknown event type {name}")
    return Envelope(
        source=record["source"],
        model=record["model"],
        dp_rank=record["dp_rank"],
        epoch=record["epoch"],
        seq=record["seq"],
        event_time_ms=record["event_time_ms"],
        event=event,
        engine_seq=record.get("engine_seq"),
    )
