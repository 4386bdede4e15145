"""What the in-process stores (the router's, and the tests' tests/helpers/memory_store.py)
share: one batch's transaction, fencing and offsets, with the batch's writes staged and
applied only when the transaction ends well."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kvledger.consumer.core.model import Plan
from kvledger.consumer.store.base import FencedError, TopicPartition

Staged = tuple[Plan, str | None, Mapping[TopicPartition, int] | None]


class StagedStore:
    """The transaction half of :class:`~.base.IndexStore`; subclasses load and apply."""

    in_process = True  # the whole index is here: load() needs no keys

    def __init__(self) -> None:
        self.offsets: dict[tuple[str, str, int], int] = {}  # (group, topic, partition)
        self._staged: list[Staged] = []
        self._claims: dict[tuple[str, str, int], int] = {}
        self._open = False

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._open:
            raise RuntimeError(f"{type(self).__name__}: transactions do not nest")
        self._open, self._staged, self._claims = True, [], {}
        try:
            yield
            for key, offset in self._claims.items():
                self.offsets.setdefault(key, offset)
            for plan, group, offsets in self._staged:
                self._apply(plan)
                if group is not None and offsets:
                    for (topic, partition), offset in offsets.items():
                        self.offsets[(group, topic, partition)] = offset
        finally:
            self._open, self._staged, self._claims = False, [], {}

    def fence(self, consumer_group: str, starts: Mapping[TopicPartition, int]) -> None:
        fenced = {}
        for (topic, partition), start in starts.items():
            key = (consumer_group, topic, partition)
            stored = self.offsets.get(key)
            if stored is None:
                self._claims[key] = start
            elif stored != start:
                fenced[partition] = (stored, start)
        if fenced:
            raise FencedError(fenced)

    def write(
        self,
        plan: Plan,
        consumer_group: str | None = None,
        next_offsets: Mapping[TopicPartition, int] | None = None,
    ) -> None:
        if not self._open:
            raise RuntimeError(f"{type(self).__name__}: call inside transaction()")
        self._staged.append((plan, consumer_group, next_offsets))

    def stored_offsets(self, consumer_group: str, topic: str) -> dict[int, int]:
        return {p: o for (g, t, p), o in self.offsets.items() if g == consumer_group and t == topic}

    def _apply(self, plan: Plan) -> None:
        raise NotImplementedError
