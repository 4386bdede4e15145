"""Validation: pure checks of a decoded event against its group spec and known blocks.

Every rejection has a stable reason code (:class:`Reason`). No broker, no database: the
caller passes the spec and the rows it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from operator import attrgetter
from typing import Any

from kvledger.consumer.core.model import HeldSpec
from kvledger.schemas.events import (
    MEDIUMS,
    RECURRENT_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventsLost,
    GroupSpec,
    Heartbeat,
    group_of,
)
from kvledger.schemas.kinds import FULL_ATTENTION_KINDS
from kvledger.schemas.topics import message_key

# Bounds that keep one message from exhausting the consumer (a 1 MiB Kafka message cannot
# legitimately carry more).
MAX_HASHES_PER_EVENT = 8192
MAX_TOKENS_PER_EVENT = 262_144
MAX_HASH_BYTES = 64
MAX_NAME_CHARS = 512  # a source, model, lora name, ownership, kind…
# Times the index can hold: from the Unix epoch to the end of year 9999 (Python's limit).
MAX_TIME_MS = 253_402_300_799_999
# An epoch is a producer's start time in ms; one more than a day ahead of the message's log
# time is not a restart, it is a number that would make every later epoch stale.
MAX_EPOCH_AHEAD_MS = 86_400_000
MAX_POSITION = 1 << 62  # token positions stay far inside PostgreSQL's bigint


class Reason(StrEnum):
    """Stable rejection reason codes (in the database, the DLQ headers and metrics)."""

    UNDECODABLE = "undecodable"
    UNKNOWN_SCHEMA = "unknown_schema"
    UNKNOWN_GROUP = "unknown_group"
    SPEC_CONFLICT = "spec_conflict"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    TOKEN_COUNT_MISMATCH = "token_count_mismatch"
    PLACEHOLDER_FOR_FULL_ATTENTION = "placeholder_for_full_attention"
    HASH_CONFLICT = "hash_conflict"
    INVALID_EVENT = "invalid_event"
    STALE_EPOCH = "stale_epoch"
    DUPLICATE = "duplicate"  # kept with its bytes; its audit row says "duplicate"
    KEY_MISMATCH = "key_mismatch"
    SEQUENCE_JUMP = "sequence_jump"
    FUTURE_EPOCH = "future_epoch"
    APPLY_ERROR = "apply_error"  # the store failed on this message alone (isolated)


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: Reason
    detail: str


def check_envelope(env: Envelope, key: bytes | None, log_time_ms: int | None) -> Invalid | None:
    """What any message must be before it may touch a stream's state: keyed by its own
    source and group, numbers and times the index can hold, text without NUL characters."""
    ev = env.event
    group = group_of(ev)
    if key != message_key(env.source, group):
        return Invalid(
            Reason.KEY_MISMATCH,
            f"key {key!r} is not {env.source!r}/{group} (the envelope's source and group)",
        )
    if bad := _bad_text(env, ev):
        return Invalid(Reason.INVALID_EVENT, bad)
    if not env.source or not env.model:
        return Invalid(Reason.INVALID_EVENT, "empty source or model")
    if env.epoch < 0 or env.seq < 0 or group < 0 or env.dp_rank < 0:
        return Invalid(
            Reason.INVALID_EVENT,
            f"negative epoch, seq, group or rank ({env.epoch}, {env.seq}, {group}, {env.dp_rank})",
        )
    if not 0 <= env.event_time_ms <= MAX_TIME_MS:
        return Invalid(Reason.INVALID_EVENT, f"event time {env.event_time_ms} ms is out of range")
    now = log_time_ms if log_time_ms is not None else env.event_time_ms
    if env.epoch > now + MAX_EPOCH_AHEAD_MS and env.epoch > MAX_EPOCH_AHEAD_MS:
        return Invalid(
            Reason.FUTURE_EPOCH,
            f"epoch {env.epoch} is more than a day past the message's time {now} ms",
        )
    if type(ev) is BlockStored:
        start = ev.token_start
        if start is not None and not 0 <= start <= MAX_POSITION:
            return Invalid(Reason.INVALID_EVENT, f"token_start {start} is out of range")
    elif type(ev) is Heartbeat:
        return _check_heartbeat(ev)
    return None


def _check_heartbeat(ev: Heartbeat) -> Invalid | None:
    if ev.interval_ms is not None and ev.interval_ms < 0:
        return Invalid(Reason.INVALID_EVENT, f"negative heartbeat interval {ev.interval_ms}")
    for name, n in (
        ("requests_running", ev.requests_running),
        ("requests_waiting", ev.requests_waiting),
    ):
        if n is not None and n < 0:
            return Invalid(Reason.INVALID_EVENT, f"negative {name} {n}")
    return None


# Each event kind's names (bounded in length; all its text but a BlockStored's extra keys).
_NAMES: dict[type, Callable[[Any], tuple[str | None, ...]]] = {
    BlockStored: attrgetter(
        "medium", "lora_name", "kv_cache_spec_kind", "locality", "ownership", "session_id"
    ),
    BlockRemoved: attrgetter("medium", "locality", "ownership"),
    AllBlocksCleared: lambda ev: (ev.medium,),
    GroupSpec: lambda ev: (ev.model, ev.kind, *(ev.surviving_media or ())),
}


def _bad_text(env: Envelope, ev: object) -> str | None:
    names = _NAMES.get(type(ev))
    named = (env.source, env.model, *names(ev)) if names is not None else (env.source, env.model)
    texts = ev.extra_keys if type(ev) is BlockStored else None
    # The common case, found by C loops first: names whose sum is within the bound hold no
    # name past it (filter drops None and empty strings, which hold neither).
    joined = "".join(filter(None, named))
    if (
        len(joined) <= MAX_NAME_CHARS
        and "\x00" not in joined
        and not (texts and any("\x00" in text for text in texts if text))
    ):
        return None
    for text in (*named, *(texts or ())):
        if text is not None and "\x00" in text:
            return f"text with a NUL character: {text[:40]!r}"
    for name in named:
        if name is not None and len(name) > MAX_NAME_CHARS:
            return f"a name of {len(name)} characters (at most {MAX_NAME_CHARS})"
    return None


def check_announcement(spec: GroupSpec, current: HeldSpec | None) -> Invalid | None:
    """An announcement must be well-formed and agree with the spec already held."""
    if (problem := spec.shape_problem()) is not None:
        return Invalid(Reason.INVALID_EVENT, problem)
    if current is not None and not current.spec.same_shape(spec):
        return Invalid(
            Reason.SPEC_CONFLICT,
            f"announced {spec.describe()} but the {current.origin} spec is "
            f"{current.spec.describe()}",
        )
    return None


def _check_hashes(hashes: Sequence[bytes]) -> Invalid | None:
    if not hashes:
        return Invalid(Reason.INVALID_EVENT, "no block hashes")
    if len(hashes) > MAX_HASHES_PER_EVENT:
        return Invalid(
            Reason.INVALID_EVENT, f"{len(hashes)} hashes exceed the bound {MAX_HASHES_PER_EVENT}"
        )
    for h in hashes:
        if not 0 < len(h) <= MAX_HASH_BYTES:
            return Invalid(Reason.INVALID_EVENT, f"a block hash of {len(h)} bytes")
    return None


def _check_medium(medium: str | None) -> Invalid | None:
    if medium is not None and medium not in MEDIUMS:
        return Invalid(Reason.INVALID_EVENT, f"unknown medium {medium!r}")
    return None


def check_stored(event: BlockStored, held: HeldSpec | None) -> Invalid | None:  # noqa: C901 - a table of refusals
    """Shape checks of a BlockStored against its group spec (no index state needed)."""
    if held is None:
        return _unknown_group(event)
    if invalid := _check_hashes(event.block_hashes) or _check_medium(event.medium):
        return invalid
    if len(event.token_ids) > MAX_TOKENS_PER_EVENT:
        return Invalid(
            Reason.INVALID_EVENT,
            f"{len(event.token_ids)} tokens exceed the bound {MAX_TOKENS_PER_EVENT}",
        )
    if event.token_start is not None and event.token_start < 0:
        return Invalid(Reason.INVALID_EVENT, f"negative token_start {event.token_start}")
    spec = held.spec
    if event.is_placeholder:
        if spec.kind in FULL_ATTENTION_KINDS:
            return Invalid(
                Reason.PLACEHOLDER_FOR_FULL_ATTENTION,
                f"placeholder payload for {spec.kind} group {event.group_idx}",
            )
        return None
    expected = spec.hash_block_size if event.partial else spec.block_size
    if event.is_state_checkpoint:
        if spec.kind not in RECURRENT_KINDS:
            return Invalid(
                Reason.TOKEN_COUNT_MISMATCH,
                f"token_ids: none for {len(event.block_hashes)} hash(es) of "
                f"{event.block_size}: a state checkpoint (vLLM 0.34) belongs to a recurrent "
                f"group, and group {event.group_idx} is {spec.kind}",
            )
        if len(event.block_hashes) != 1:
            return Invalid(
                Reason.INVALID_EVENT,
                f"block_hashes: a state checkpoint names one hash (the state's), not "
                f"{len(event.block_hashes)}",
            )
    if event.block_size != expected:
        what = " (hash size, partial tail)" if event.partial else ""
        return Invalid(
            Reason.BLOCK_SIZE_MISMATCH,
            f"block_size {event.block_size} but the {held.origin} spec of group "
            f"{event.group_idx} says {expected}{what}",
        )
    if event.is_state_checkpoint:
        return None
    if len(event.token_ids) != len(event.block_hashes) * event.block_size:
        return Invalid(
            Reason.TOKEN_COUNT_MISMATCH,
            f"{len(event.token_ids)} tokens for {len(event.block_hashes)} hashes of "
            f"{event.block_size}",
        )
    return None


def check_removed(event: BlockRemoved, held: HeldSpec | None) -> Invalid | None:
    if held is None:
        return _unknown_group(event)
    return _check_hashes(event.block_hashes) or _check_medium(event.medium)


def _unknown_group(event: BlockStored | BlockRemoved) -> Invalid:
    return Invalid(
        Reason.UNKNOWN_GROUP,
        f"group {group_of(event)} has no declared or announced spec "
        "(`kvledger groups declare`, then `kvledger dlq replay`)",
    )


def check_cleared(event: AllBlocksCleared) -> Invalid | None:
    return _check_medium(event.medium)


def check_lost(event: EventsLost) -> Invalid | None:
    """A lost range names engine batch numbers: first >= 0, last >= first - 1 (unknown size)."""
    if event.first_seq < 0 or event.last_seq < event.first_seq - 1:
        return Invalid(
            Reason.INVALID_EVENT,
            f"lost range {event.first_seq}..{event.last_seq} is not a range of batch numbers",
        )
    return None
