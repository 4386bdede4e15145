"""The one interface every index store implements (PostgreSQL, memory).

A store keeps the index and each consumer group's offsets. One batch is one
:meth:`IndexStore.transaction`: fence the batch's partitions, load the state the batch
touches, write the plan the core made and the next offsets. Nothing is visible to readers
before the transaction commits, and a failure anywhere leaves the store as it was.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Protocol

from kvledger.consumer.core.model import Needs, Plan, Snapshot
from kvledger.schemas.errors import KvledgerError

TopicPartition = tuple[str, int]


class FencedError(KvledgerError):
    """Another consumer advanced a partition of this batch: the batch must be abandoned."""

    def __init__(self, partitions: dict[int, tuple[int, int]]) -> None:
        detail = ", ".join(f"{p}: stored {s}, batch starts {b}" for p, (s, b) in partitions.items())
        super().__init__(f"fenced on partitions {detail}")
        self.partitions = partitions


class IndexStore(Protocol):
    """Where the index lives. Calls other than ``transaction`` run inside one."""

    #: The store holds the whole index in this process and :meth:`load` answers any key,
    #: reading of the needs only ``Needs.replayed``: the pipeline computes only that.
    in_process: bool

    def transaction(self) -> AbstractContextManager[None]:
        """One batch's unit of work: committed on a normal exit, undone on an exception."""

    def fence(self, consumer_group: str, starts: Mapping[TopicPartition, int]) -> None:
        """Claim the batch's partitions: raise :class:`FencedError` unless each partition's
        stored next offset is the batch's first offset there (a partition with no stored
        offset is claimed at the batch's start). Holds the claim until the transaction ends."""

    def load(self, needs: Needs) -> Snapshot:
        """The state the batch touches, as committed before this transaction."""

    def write(
        self,
        plan: Plan,
        consumer_group: str | None = None,
        next_offsets: Mapping[TopicPartition, int] | None = None,
    ) -> None:
        """Write the plan and, when given, the consumer group's next offsets."""

    def stored_offsets(self, consumer_group: str, topic: str) -> dict[int, int]:
        """Each partition's next offset for a consumer group (committed state)."""


def batch_offsets(
    coordinates: Iterator[tuple[str, int, int]],
) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    """(first offset, next offset) per partition of a batch's (topic, partition, offset)s."""
    first: dict[TopicPartition, int] = {}
    nxt: dict[TopicPartition, int] = {}
    for topic, partition, offset in coordinates:
        first.setdefault((topic, partition), offset)
        nxt[(topic, partition)] = offset + 1
    return first, nxt
