"""Planning the next batch while PostgreSQL writes the last one.

A consumer alone leaves itself and PostgreSQL half idle: it decodes, loads and plans a batch
(Python), then waits while PostgreSQL writes it. :class:`Ahead` overlaps the two: batch N's
transaction (fence, write, dead letters, commit: :func:`~.pipeline.write_batch`) runs on a
writer thread with the store's connection, while the caller decodes batch N+1, loads what it
touches on a second connection and plans it.

N+1's load reads what was committed before N. The state N changes is known exactly: its
plan holds the new value of every key it touched (blocks, residencies, source streams,
lives, group specs), and :class:`Overlay` lays those over the load. A key N did not touch
reads the same before and after N's commit, so the planned state is the state N+1 will be
written over. Whole holders (what a clear, a goodbye or a restart ends) are read as they
were before N, and N's residencies are added to them: the planner ends only those it
finds covered and still referenced, by the overlaid counts. A replay's late removals are
not overlaid: a replay is planned after N commits (:meth:`Ahead.plan` returns None).

Nothing of the commit order changes: N+1 is written, with its fence, only after N has
committed, and if N fails, N+1's plan is dropped and the caller applies both again from the
store (``IndexConsumer``: the batch's usual retries and isolation).
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from kvledger.consumer.core.compact import BlockRows, Residencies
from kvledger.consumer.core.model import (
    GroupKey,
    HeldSpec,
    Needs,
    Plan,
    Snapshot,
    SourceKey,
    SourceLife,
    SourceState,
)
from kvledger.consumer.core.needs import needs
from kvledger.consumer.core.plan import make_plan
from kvledger.consumer.inbound import Decoded, Inbound
from kvledger.consumer.pipeline import (
    BatchResult,
    DeadLetterSink,
    decode_batch,
    fence_points,
    write_batch,
)
from kvledger.consumer.store.base import TopicPartition
from kvledger.consumer.store.postgres import PostgresStore
from kvledger.schemas.codec import Codec
from kvledger.schemas.events import GroupSpec


@dataclass(slots=True)
class Overlay:
    """The state one batch's plan leaves behind, for every key it touched (a residency of
    None: none is left)."""

    specs: dict[GroupKey, HeldSpec] = field(default_factory=dict)
    # The plan's block rows and residencies (compact, never changed after the plan).
    blocks: BlockRows | None = None
    refs: Residencies | None = None
    sources: dict[SourceKey, SourceState] = field(default_factory=dict)
    lives: dict[str, SourceLife] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan) -> Overlay:
        """What ``plan`` leaves: its objects copied (the writer thread reads the plan's while
        the next batch's planner changes its own)."""
        out = cls()
        for spec, _ in plan.new_specs:  # as the store reads a spec back: its shape only
            shape = GroupSpec(
                spec.model,
                spec.group_idx,
                spec.kind,
                spec.block_size,
                spec.hash_block_size,
                spec.sliding_window,
            )
            out.specs.setdefault(GroupKey(spec.model, spec.group_idx), HeldSpec(shape, "announced"))
        out.blocks, out.refs = plan.rows, plan.refs
        out.sources = {key: copy.copy(state) for key, state in plan.sources.items()}
        out.lives = {source: copy.copy(life) for source, life in plan.lives.items()}
        return out

    @staticmethod
    def covers(wanted: Needs) -> bool:
        """Whether a batch needing ``wanted`` can be planned over a load and this overlay:
        not a replay's (its late removals are read from the audit log)."""
        return not wanted.replayed

    def over(self, snap: Snapshot) -> Snapshot:
        """``snap`` (read before this overlay's batch committed) as that batch left it."""
        specs = {**self.specs, **snap.specs} if self.specs else snap.specs
        return replace(
            snap,
            specs=specs,
            block_base=self.blocks,
            residency_base=self.refs,
            sources={**snap.sources, **self.sources},
            lives={**snap.lives, **self.lives},
        )


@dataclass(slots=True)
class Planned:
    """A batch decoded and planned, not yet written."""

    messages: Sequence[Inbound]
    batch: Sequence[Decoded]
    plan: Plan
    started: float  # when its work began (time.monotonic)


@dataclass(slots=True)
class InFlight:
    """A planned batch being written on the writer thread."""

    planned: Planned
    overlay: Overlay
    future: Future[BatchResult]


# How long the planning thread may hold the GIL while the writer thread waits for it. The
# writer needs it back after each of its statements' round trips to PostgreSQL; at Python's
# default (5 ms) it waited that long each time, and PostgreSQL sat idle. Side by side on
# bench.consume's batches, planning ahead: 73k-77k block events/s at 5 ms, 88k-96k at
# 0.1-1 ms.
SWITCH_INTERVAL_S = 0.0002


class Ahead:
    """Batches planned on the caller's thread over ``reader``'s connection and written on a
    writer thread over ``writer``'s (see the module docstring). One batch is in flight at
    a time; :meth:`take` hands it back to the caller, who waits for it. While it is open
    the process's threads trade the GIL every ``SWITCH_INTERVAL_S``."""

    def __init__(self, reader: PostgresStore, consumer_group: str) -> None:
        self.reader = reader
        self.consumer_group = consumer_group
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvledger-writer")
        self._flight: InFlight | None = None
        # The batch last taken, let go once the next is submitted: freeing a batch's
        # decoded messages takes ~10 ms, and the writer should not wait for it.
        self._taken: InFlight | None = None
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))

    @property
    def busy(self) -> bool:
        return self._flight is not None

    def plan(self, messages: Sequence[Inbound], batch: Sequence[Decoded]) -> Planned | None:
        """``batch`` planned over what is committed and the batch in flight; None when it
        needs what the flight's overlay cannot give (take the flight first, then plan)."""
        started = time.monotonic()
        self._taken = None
        wanted = needs(batch, keys=True)
        flight = self._flight
        if flight is not None and not Overlay.covers(wanted):
            return None
        with self.reader.transaction():
            snap = self.reader.load(wanted)
        if flight is not None:
            snap = flight.overlay.over(snap)
        return Planned(messages, batch, make_plan(batch, snap), started)

    def submit(
        self,
        planned: Planned,
        writer: PostgresStore,
        starts: Mapping[TopicPartition, int],
        next_offsets: dict[TopicPartition, int],
        dead_letters: DeadLetterSink | None,
    ) -> None:
        """Write ``planned`` on the writer thread (nothing may be in flight)."""
        if self._flight is not None:
            raise RuntimeError("Ahead.submit: a batch is still in flight (take it first)")
        future = self._pool.submit(
            write_batch,
            writer,
            planned.plan,
            self.consumer_group,
            starts,
            next_offsets,
            dead_letters,
        )
        self._flight = InFlight(planned, Overlay.of(planned.plan), future)

    def take(self) -> InFlight | None:
        """The batch in flight, no longer tracked here (its future says how it ended)."""
        flight, self._flight = self._flight, None
        self._taken = flight
        return flight

    def close(self) -> None:
        """Wait for the writer thread to finish what it holds and end it."""
        self._pool.shutdown(wait=True)
        self._taken = None
        sys.setswitchinterval(self._switch)


def apply_in_turn(
    batches: Iterable[Sequence[Inbound]],
    codec: Codec,
    writer: PostgresStore,
    reader: PostgresStore,
    consumer_group: str,
) -> Iterator[BatchResult]:
    """Each batch planned while the one before it is written, each one's result once it
    has committed and the next batch is on its way (the writer never waits for the
    caller); the first failure is raised, with nothing after it written. Benchmarks and
    tests drive :class:`Ahead` with it; ``IndexConsumer`` adds retries and isolation."""
    ahead = Ahead(reader, consumer_group)
    read_from: dict[TopicPartition, int] = {}

    def landed() -> BatchResult | None:
        flight = ahead.take()
        if flight is None:
            return None
        result = flight.future.result()
        read_from.update(result.next_offsets)
        return result

    try:
        for messages in batches:
            batch = decode_batch(messages, codec)
            planned = ahead.plan(messages, batch)
            result = landed()
            if planned is None:
                planned = ahead.plan(messages, batch)
                assert planned is not None  # nothing is in flight
            starts, next_offsets = fence_points(batch, read_from)
            ahead.submit(planned, writer, starts, next_offsets, None)
            if result is not None:
                yield result
        if (result := landed()) is not None:
            yield result
    finally:
        ahead.close()
