"""The audit log's rows: one per message, whatever became of it (pure)."""

from __future__ import annotations

from datetime import datetime

from kvledger.consumer.core.model import AuditRow, new_tuple
from kvledger.consumer.inbound import Decoded
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, group_of


def audit_row(
    d: Decoded, status: str, reason: str | None, counts: tuple[int, int], when: datetime | None
) -> AuditRow:
    """A message's audit row: its coordinates, what it was, what became of it (``status``,
    ``reason``), ``counts``: the hashes it named and its no-op hashes (removals that found
    nothing, reused blocks a store reported); ``when`` is the event time (None for an
    undecodable message)."""
    msg, env = d.message, d.envelope
    hashes, noop = counts
    if env is None:
        values: tuple[object, ...] = (
            msg.topic,
            msg.partition,
            msg.offset,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            hashes,
            0,
            status,
            reason,
            None,
        )
    else:
        ev = env.event
        medium = (
            ev.medium if isinstance(ev, BlockStored | BlockRemoved | AllBlocksCleared) else None
        )
        values = (
            msg.topic,
            msg.partition,
            msg.offset,
            env.source,
            env.model,
            env.epoch,
            env.seq,
            type(ev).__name__,
            group_of(ev),
            medium,
            getattr(ev, "ownership", None),
            hashes,
            noop,
            status,
            reason,
            when,
        )
    return new_tuple(AuditRow, values)


def replay_reason(reason: str | None) -> str:
    """The audit log's reason for a message a replay applied."""
    return reason if reason == "replayed_without_holders" else "replayed"
