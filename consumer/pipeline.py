"""The consumer's pipeline for one batch, on one page.

    Kafka messages ─▶ decode ─▶ (one store transaction:) fence ─▶ load what the batch
    touches ─▶ plan: sequence → validate → index rules (pure core) ─▶ write plan + offsets
    ─▶ dead-letter the rejections, acknowledged ─▶ commit ─▶ (caller) offsets hint to Kafka

:func:`run_batch` is that wiring; :mod:`.service` only keeps the Kafka client alive around
it (assignment, retries; the reading and its error triage are :mod:`.loop`'s), and
:func:`replay_batch` re-applies rejected messages through the same core.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvledger.consumer.core.model import Plan, Rejection
from kvledger.consumer.core.needs import needs
from kvledger.consumer.core.plan import make_plan
from kvledger.consumer.inbound import Decoded, Inbound, decode
from kvledger.consumer.store.base import IndexStore, TopicPartition, batch_offsets
from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import DecodeError

logger = logging.getLogger(__name__)


class DeadLetterSink(Protocol):
    def send(self, rejections: Sequence[Rejection]) -> None:
        """Deliver every rejection, or raise (the batch's transaction is then undone)."""


@dataclass(frozen=True, slots=True)
class BatchResult:
    plan: Plan
    next_offsets: dict[TopicPartition, int] = field(default_factory=dict)


def run_batch(  # noqa: PLR0913 - the batch and its sink, then 3 optional inputs by name
    messages: Sequence[Inbound],
    codec: Codec,
    store: IndexStore,
    consumer_group: str,
    dead_letters: DeadLetterSink | None = None,
    read_from: Mapping[TopicPartition, int] | None = None,
    poisoned: Mapping[tuple[str, int, int], str] | None = None,
) -> BatchResult:
    """Apply one batch of consumed messages, exactly once.

    ``read_from``: where the caller's reading of each partition began (its seek, or the end
    of its previous batch). A batch may start past it when only records that are no data
    lie between (a transaction's commit marker, an aborted transaction's messages, which a
    read-committed consumer skips); the fence then expects the stored offset there.
    ``poisoned``: messages (topic, partition, offset) that the store failed on alone, with
    the error: each is rejected as ``apply_error`` with that text instead of applied.

    Commit order (the reason a crash at any instant neither loses nor repeats an effect):

    1. decode every message (pure: an undecodable one becomes a value, later rejected);
    2. open one store transaction and fence: each partition's stored next offset must be
       the batch's first offset (or where the caller's reading began), else another
       consumer owns it (:class:`FencedError`, the batch is abandoned and the caller
       re-seeks);
    3. load the state the batch touches and plan the batch with the pure core (sequence,
       validation, reference counts, history, audit rows, rejections);
    4. write the plan and the partitions' next offsets in that same transaction;
    5. produce the rejections to the dead-letter topic and wait for their acknowledgement
       (a failure raises and undoes the transaction: the batch is retried, nothing lost;
       a crash after this and before the commit can repeat a dead letter, never lose one);
    6. commit. Only then may the caller commit the offsets to Kafka, as a hint for lag
       tools (the store's offsets are the truth the consumer seeks to on assignment).
    """
    batch = decode_batch(messages, codec, poisoned)
    starts, next_offsets = fence_points(batch, read_from)
    with store.transaction():
        store.fence(consumer_group, starts)
        plan = make_plan(batch, store.load(needs(batch, keys=not store.in_process)))
        _write(store, plan, consumer_group, next_offsets, dead_letters)
    warn_model_changes(plan)
    return BatchResult(plan, next_offsets)


def decode_batch(
    messages: Sequence[Inbound],
    codec: Codec,
    poisoned: Mapping[tuple[str, int, int], str] | None = None,
) -> list[Decoded]:
    """Step 1 of :func:`run_batch`: each message decoded, or its poison kept as its error."""
    return [
        decode(m, codec)
        if poisoned is None or (m.topic, m.partition, m.offset) not in poisoned
        else Decoded(m, None, DecodeError("apply_error", poisoned[m.topic, m.partition, m.offset]))
        for m in messages
    ]


def write_batch(  # noqa: PLR0913 - run_batch's, the plan and offsets for the messages
    store: IndexStore,
    plan: Plan,
    consumer_group: str,
    starts: Mapping[TopicPartition, int],
    next_offsets: dict[TopicPartition, int],
    dead_letters: DeadLetterSink | None = None,
) -> BatchResult:
    """Steps 2 and 4-6 of :func:`run_batch` for a batch planned already (consumer/ahead.py):
    one transaction that fences, writes the plan and the next offsets, and sends the dead
    letters; committed on return."""
    with store.transaction():
        store.fence(consumer_group, starts)
        _write(store, plan, consumer_group, next_offsets, dead_letters)
    warn_model_changes(plan)
    return BatchResult(plan, next_offsets)


def _write(
    store: IndexStore,
    plan: Plan,
    consumer_group: str,
    next_offsets: dict[TopicPartition, int],
    dead_letters: DeadLetterSink | None,
) -> None:
    store.write(plan, consumer_group, next_offsets)
    if dead_letters is not None:
        dead_letters.send(plan.rejected)


def fence_points(
    batch: Sequence[Decoded], read_from: Mapping[TopicPartition, int] | None
) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    """Per partition, the offset the store must stand at for this batch (its first, or
    where the caller's reading began: see :func:`run_batch`) and the next one after it."""
    starts, next_offsets = batch_offsets(
        (d.message.topic, d.message.partition, d.message.offset) for d in batch
    )
    if read_from:
        for tp, first in starts.items():
            began = read_from.get(tp)
            if began is not None and 0 <= began <= first:
                starts[tp] = began
    return starts, next_offsets


def warn_model_changes(plan: Plan) -> None:
    for change in plan.model_changes:
        logger.warning(
            "source %s changed model from %s to %s: one source id per engine and model "
            "(`kvledger sources` shows the change)",
            change.source,
            change.previous,
            change.model,
        )


def replay_batch(batch: Sequence[Decoded], store: IndexStore) -> Plan:
    """Re-apply rejected messages (no sequence checks, no offsets) in the caller's order.

    Applied ones update their audit rows and leave the reject list; the others stay.
    """
    with store.transaction():
        wanted = needs(batch, check_sequence=False, keys=not store.in_process)
        plan = make_plan(batch, store.load(wanted), replay=True)
        store.write(plan)
    return plan
