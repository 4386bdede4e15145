"""The router index's lookups: the SQL functions' answers computed from its memory.

:class:`Lookups` answers from a :class:`~kvledger.serving.router.store.RouterStore` under
the lock its writer takes per chunk applied (:mod:`.index`), so a lookup waits for one chunk
at most; the walks themselves are :mod:`.match`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from kvledger.consumer.core.model import GroupKey
from kvledger.schemas.lookup import EngineLoad, Holder
from kvledger.serving.lookup.api import Granularity, deepest_states
from kvledger.serving.router import match as m
from kvledger.serving.router.store import RouterStore


class Lookups:
    """The lookups of :class:`~kvledger.serving.router.index.RouterIndex`, over its
    ``store`` and under its ``lock`` (each as :class:`~kvledger.serving.lookup.api.PrefixIndex`
    answers it from PostgreSQL)."""

    store: RouterStore
    lock: threading.RLock

    def match(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
        self,
        model: str,
        group_idx: int,
        hashes: Sequence[bytes],
        granularity: Granularity = "block",
        include_silent: bool = False,
        silent_after: timedelta | None = None,
    ) -> list[Holder]:
        """As :meth:`PrefixIndex.match`, from memory."""
        with self.lock:
            found = m.held_prefix(self.store, model, group_idx, hashes, granularity)
            return m.answer(self.store, found, include_silent, silent_after, _now())

    def match_tokens(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
        self,
        model: str,
        group_idx: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        include_silent: bool = False,
        silent_after: timedelta | None = None,
        cache_salt: str | None = None,
    ) -> list[Holder]:
        """As :meth:`PrefixIndex.match_tokens`, from memory."""
        with self.lock:
            found = m.held_tokens(self.store, model, group_idx, token_ids, lora_name, cache_salt)
            return m.answer(self.store, found, include_silent, silent_after, _now())

    def held_path(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
        self,
        model: str,
        group_idx: int,
        token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        holder: tuple[str, str, str],
    ) -> list[bytes]:
        """The block hashes of the prompt's leading blocks that ``holder`` (instance, medium,
        ownership) holds, found by their tokens (what a decision by token ids captured)."""
        with self.lock:
            return m.held_path(
                self.store, model, group_idx, token_ids, lora_name, cache_salt, holder
            )

    def state_checkpoints(
        self, model: str, group_idx: int, hashes: Sequence[bytes], upto: Mapping[str, int]
    ) -> dict[str, int]:
        """As :meth:`PrefixIndex.state_checkpoints`, from memory."""
        top = min(max(upto.values(), default=0), len(hashes))
        found: list[tuple[str, int]] = []
        with self.lock:
            g = self.store.groups.get(GroupKey(model, group_idx))
            if g is None:
                return {}
            holders = self.store.holders
            for pos in range(top, 0, -1):
                found += [(holders[hid][0], pos) for hid, _, _ in g.runs([hashes[pos - 1]])]
        return deepest_states(found, upto)

    def block_size(self, model: str, group_idx: int) -> int | None:
        """The group's block size in tokens (None: no such group in the index)."""
        with self.lock:
            held = self.store.specs.get(GroupKey(model, group_idx))
        return held.spec.block_size if held is not None and held.spec.block_size > 0 else None

    def states(self, instances: Sequence[str], silent_after: timedelta | None) -> dict[str, str]:
        """Each instance's state (live, silent, closed, unknown) in the liveness window."""
        window = silent_after if silent_after is not None else m.DEFAULT_SILENT_AFTER
        now = _now()
        with self.lock:
            return {i: m.state_of(self.store.lives.get(i), now, window) for i in instances}

    def loads(self, model: str, silent_after: timedelta | None = None) -> list[EngineLoad]:
        """As :meth:`PrefixIndex.loads`, from memory."""
        now = _now()
        with self.lock:
            return m.loads(self.store.lives, model, now, silent_after)

    def footprint(self) -> dict[tuple[str, str], dict[str, int]]:
        """Blocks held per (instance, model) and tier (the dashboard's fleet in memory). The
        count walks every holder's blocks, so the lock is taken per group and holder (a
        lookup waits for one holder's list at most); the dashboard shares each answer
        between its viewers (serving/lookup/dashboard.py's SharedAnswers)."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        with self.lock:
            groups, holders = list(self.store.groups.items()), list(self.store.holders)
        for key, g in groups:
            for hid, (instance, medium, _) in enumerate(holders):
                with self.lock:
                    n = len(g.held_by(hid))
                if n:
                    tiers = out.setdefault((instance, key[0]), {})
                    tiers[medium] = tiers.get(medium, 0) + n
        return out

    def knows_group(self, model: str, group_idx: int) -> bool:
        """As :meth:`PrefixIndex.knows_group`, from memory."""
        with self.lock:
            return GroupKey(model, group_idx) in self.store.specs


def _now() -> datetime:
    return datetime.now(UTC)
