"""The router's store: the index in memory, kept to what lookups and the rules need.

It implements :class:`~kvledger.consumer.store.base.IndexStore`, so the router tails the
topic through the same pipeline and index rules (consumer/core/) as the PostgreSQL
consumer. It keeps, per (model, group), a :class:`~.groups.BlockGroup`: each block's
content, the holders of each block as a bitmask of holder ids (a prefix walk is then one
AND per position), reference counts above one, and what a token walk follows from the
root, in the compiled core (rust/src/group.rs, through :mod:`.groups`: a lookup is one
native call; its pure-Python twin, the tests' reference, is in tests/helpers/pure_router/);
plus the group specs, the source streams' sequence states and the sources' lives. History,
the audit log and the rejections stay in PostgreSQL: a router does not answer audits.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from kvledger.consumer.core.compact import upgrades
from kvledger.consumer.core.model import (
    BlockKey,
    BlockRow,
    BlockWrite,
    GroupKey,
    HeldSpec,
    HolderKey,
    Needs,
    Plan,
    Residency,
    ResidencyKey,
    Snapshot,
    SourceKey,
    SourceLife,
    SourceState,
    new_tuple,
)
from kvledger.consumer.store.staged import StagedStore
from kvledger.serving.router.groups import (
    BlockGroup,
    Group,
    SlotTable,
    copies_hashes,
    dynamo_slots,
)

Holder = tuple[str, str, str]  # (instance, medium, ownership)
_NO_TIME = datetime(1970, 1, 1, tzinfo=UTC)


class Lives(dict[str, SourceLife]):
    """The sources' lives, noting which sources' lives changed since the last
    :meth:`drain` (what the Dynamo API's slot table follows: lookup/dynamo.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed: set[str] = set()

    def drain(self) -> set[str]:
        """The sources whose lives were set or removed since the last drain."""
        changed, self.changed = self.changed, set()
        return changed

    def __setitem__(self, name: str, life: SourceLife) -> None:
        self.changed.add(name)
        super().__setitem__(name, life)

    def __delitem__(self, name: str) -> None:
        self.changed.add(name)
        super().__delitem__(name)

    def update(self, *args: Any, **kwargs: SourceLife) -> None:
        new = dict(*args, **kwargs)
        self.changed.update(new)
        super().update(new)

    def setdefault(self, name: str, life: SourceLife) -> SourceLife:
        self.changed.add(name)
        return super().setdefault(name, life)

    def pop(self, name: str, *default: Any) -> Any:
        self.changed.add(name)
        return super().pop(name, *default)

    def popitem(self) -> tuple[str, SourceLife]:
        name, life = super().popitem()
        self.changed.add(name)
        return name, life

    def clear(self) -> None:
        self.changed.update(self)
        super().clear()

    def __ior__(self, other: Any) -> Lives:  # type: ignore[override,misc]
        self.update(other)
        return self


class RouterStore(StagedStore):
    """The router's in-memory index (see the module docstring). One writer at a time; the
    RouterIndex serializes writes and lookups with its lock."""

    def __init__(self, dynamo: bool = False) -> None:
        super().__init__()
        self.dynamo = dynamo  # its groups keep Dynamo's block hashes (serve --dynamo-api)
        self.specs: dict[GroupKey, HeldSpec] = {}
        self.groups: dict[GroupKey, BlockGroup] = {}
        self.holder_ids: dict[Holder, int] = {}
        self.holders: list[Holder] = []
        self.sources: dict[SourceKey, SourceState] = {}
        self.lives = Lives()
        self.clock = 0  # what stores and holders stamp on blocks (whole seconds)

    # ------------------------------------------------------------------ building
    def group(self, key: GroupKey) -> BlockGroup:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = Group()
            g.set_clock(self.clock)
            if self.dynamo:
                g.enable_dynamo()
        return g

    def dynamo_slots(self) -> SlotTable:
        """A new slot table for Dynamo answers from its groups (serve --dynamo-api)."""
        return dynamo_slots(Group)

    def copies_hashes(self) -> bool:
        """Whether its groups copy the hash objects they are given (the compiled core's
        do; the pure twin keeps them)."""
        return copies_hashes(Group)

    def set_clock(self, now: int) -> None:
        """The time (whole seconds) that stores and holders from now on stamp on the blocks
        they touch."""
        self.clock = now
        for g in self.groups.values():
            g.set_clock(now)

    def expire_slices(self, cutoff: int, rows: int) -> Iterator[int]:
        """Forget the blocks no one holds, no block names as its parent, and nothing stored
        or held since ``cutoff``, a slice of ``rows`` rows at a time: each step (run the
        iterator under the writers' lock, released between steps) gives how many went.
        Lookups count holders, so no answer changes; the rules meet such a block's hash
        again as a new one."""
        for g in list(self.groups.values()):
            done = False
            while not done:
                dropped, done = g.expire_some(max(cutoff, 0), rows)
                yield dropped

    def holder_id(self, holder: Holder) -> int:
        hid = self.holder_ids.get(holder)
        if hid is None:
            hid = self.holder_ids[holder] = len(self.holders)
            self.holders.append(holder)
        return hid

    def hold(self, key: ResidencyKey, refcount: int) -> None:
        """Set one residency's reference count (0: it ends)."""
        g = self.group(key[:2])  # type: ignore[arg-type]  # (model, group_idx): a GroupKey's equal
        g.hold(key.block_hash, self.holder_id(key[3:]), refcount)

    def refcount(self, key: ResidencyKey) -> int:
        g: BlockGroup | None = self.groups.get(key[:2])  # type: ignore[call-overload]
        hid = self.holder_ids.get(key[3:])
        if g is None or hid is None:
            return 0
        return g.refcount(key[2], hid)  # a ResidencyKey, or the core's plain tuple of it

    # ------------------------------------------------------------------ IndexStore

    def load(self, needs: Needs) -> Snapshot:
        return Snapshot(
            self.specs,
            _Blocks(self),
            _Residencies(self),
            _Held(self),
            self.sources,
            self.lives,
            history=False,
        )

    def apply_now(self, plan: Plan) -> None:
        """Apply a plan at once, inside an open transaction (the router's lane plans the
        messages its groups decline a few at a time: :mod:`.lane`); the transaction's
        commit then writes the offsets."""
        if not self._open:
            raise RuntimeError("RouterStore.apply_now: call inside transaction()")
        self._apply(plan)

    def _apply(self, plan: Plan) -> None:
        for spec, _ in plan.new_specs:
            self.specs.setdefault(GroupKey(spec.model, spec.group_idx), HeldSpec(spec, "announced"))
        for key, write in plan.blocks.items():
            self._merge(key, write)
        for d in plan.residencies:
            self.hold(d.key, d.refcount)
        self.sources.update(plan.sources)
        self.lives.update(plan.lives)

    def _merge(self, key: BlockKey, write: BlockWrite) -> None:
        """As the PostgreSQL store merges a block row (content upgrades, first metadata)."""
        g = self.group(key[:2])  # type: ignore[arg-type]
        new, h = write.row, key.block_hash
        plain, salt = walkable(write.extra_keys, new.parent_hash is None)
        fields = g.row(h)
        if fields is None:
            g.add_row(h, *new, write.lora_name, plain, salt)
            return
        known = new_tuple(BlockRow, fields)
        old_lora, old_plain, old_salt = g.meta(h) or (None, True, None)
        lora = old_lora if old_lora is not None else write.lora_name
        # Metadata is kept from the first writer that has it, as the PostgreSQL store keeps
        # a block's first extra keys: a row with extra keys (not plain, or salted) keeps
        # what they made of it, however later batches are cut.
        if not old_plain or old_salt is not None:
            plain, salt = old_plain, old_salt
        if upgrades(known, new):
            g.add_row(h, *new, lora, plain, salt)
        elif (lora, plain, salt) != (old_lora, old_plain, old_salt):
            g.set_meta(h, lora, plain, salt)


def walkable(extra_keys: str | None, first: bool) -> tuple[bool, str | None]:
    """(plain, salt) of a block's extra keys (canonical JSON, or None): a block with none is
    walkable by tokens, and so is a ``first`` block (no parent) whose only extra key is a
    cache salt (``["<salt>"]``, as vLLM and the SGLang relay publish a salted request's
    first block): the token walk of that salt starts there."""
    if extra_keys is None:
        return True, None
    if not first:
        return False, None
    try:
        keys = json.loads(extra_keys)
    except ValueError:
        return False, None
    if isinstance(keys, list) and len(keys) == 1 and isinstance(keys[0], str):
        return True, keys[0]
    return False, None


# ---------------------------------------------------------------------- snapshot views
class _Blocks(Mapping[BlockKey, BlockRow]):
    def __init__(self, store: RouterStore) -> None:
        self.store = store

    def __getitem__(self, key: BlockKey) -> BlockRow:
        row = self.get(key)
        if row is None:
            raise KeyError(key)
        return row

    def get(self, key: BlockKey, default: BlockRow | None = None) -> BlockRow | None:  # type: ignore[override]
        """Without Mapping.get's KeyError per miss: the planner asks for every hash of
        every stored event, most of them new."""
        g = self.store.groups.get(key[:2])  # type: ignore[call-overload]
        row = g.row(key[2]) if g is not None else None
        return new_tuple(BlockRow, row) if row is not None else default

    def __iter__(self) -> Iterator[BlockKey]:
        for (model, group), g in self.store.groups.items():
            for h in g.hashes():
                yield BlockKey(model, group, h)

    def __len__(self) -> int:
        return sum(len(g) for g in self.store.groups.values())


class _Residencies(Mapping[ResidencyKey, Residency]):
    def __init__(self, store: RouterStore) -> None:
        self.store = store

    def __getitem__(self, key: ResidencyKey) -> Residency:
        residency = self.get(key)
        if residency is None:
            raise KeyError(key)
        return residency

    def get(self, key: ResidencyKey, default: Residency | None = None) -> Residency | None:  # type: ignore[override]
        """Without Mapping.get's KeyError per miss (most residencies an event opens are new)."""
        count = self.store.refcount(key)
        # The router keeps no history: the opening message is not needed for lookups.
        return Residency(count, None, _NO_TIME, "", 0, 0) if count else default

    def __iter__(self) -> Iterator[ResidencyKey]:
        store = self.store
        for (model, group), g in store.groups.items():
            for h, hid, _ in g.residencies():
                yield ResidencyKey(model, group, h, *store.holders[hid])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Held(Mapping[HolderKey, Collection[bytes]]):
    """Each holder's hashes, computed when asked (restarts and clears are rare)."""

    def __init__(self, store: RouterStore) -> None:
        self.store = store

    def __getitem__(self, key: HolderKey) -> Collection[bytes]:
        hid = self.store.holder_ids.get((key.instance, key.medium, key.ownership))
        g = self.store.groups.get(GroupKey(key.model, key.group_idx))
        if hid is None or g is None:
            raise KeyError(key)
        return _HeldHashes(g, hid)

    def items(self) -> Iterator[tuple[HolderKey, Collection[bytes]]]:  # type: ignore[override]
        """Lazily: a holder's hashes are found only when a caller iterates them."""
        for key in self:
            yield key, self[key]

    def __iter__(self) -> Iterator[HolderKey]:
        for model, group in self.store.groups:
            for instance, medium, own in self.store.holders:
                yield HolderKey(model, group, instance, medium, own)

    def __len__(self) -> int:
        return len(self.store.groups) * len(self.store.holders)


class _HeldHashes(Collection[bytes]):
    def __init__(self, group: BlockGroup, hid: int) -> None:
        self.group, self.hid = group, hid

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.group.held_by(self.hid))

    def __contains__(self, h: object) -> bool:
        return isinstance(h, bytes) and self.group.refcount(h, self.hid) > 0

    def __len__(self) -> int:
        return sum(1 for _ in self)
