"""The router's store: the index in memory, kept to what lookups and the rules need.

It implements :class:`~kvledger.consumer.store.base.IndexStore`, so the router tails the
topic through the same pipeline and pure core as the PostgreSQL consumer. It keeps, per
(model, group): each block's content (tokens packed as int32 bytes), the holders of each
block as a bitmask of holder ids (a prefix walk is then one AND per position), reference
counts above one, and the chain's children for token walks; plus the group specs, the
source streams' sequence states and the sources' lives. History, the audit log and the
rejections stay in PostgreSQL: a router does not answer audits.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

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
from kvledger.consumer.core.validate import upgrades
from kvledger.consumer.router.masks import HolderMasks, Masks
from kvledger.consumer.store.staged import StagedStore

Holder = tuple[str, str, str]  # (instance, medium, ownership)
_NO_TIME = datetime(1970, 1, 1, tzinfo=UTC)


_PACKERS: dict[int, struct.Struct] = {}


def pack(tokens: Sequence[int]) -> bytes:
    """Token ids as native int32 bytes (compact, and compared as bytes), as array("i")
    would give them; a Struct per length packs them ~2x faster."""
    packer = _PACKERS.get(len(tokens))
    if packer is None:
        packer = _PACKERS[len(tokens)] = struct.Struct(f"{len(tokens)}i")
    return packer.pack(*tokens)


# Token positions repeat across blocks (every prompt's block i starts at i * block_size):
# one int object per distinct position instead of one per block (~32 bytes each).
_POSITIONS: dict[int, int] = {}


def position(start: int | None) -> int | None:
    if start is None or not 0 <= start < 1 << 20:
        return start
    return _POSITIONS.setdefault(start, start)


@dataclass(slots=True)
class Row:
    """One block's content as the router keeps it."""

    parent: bytes | None
    token_start: int | None
    tokens: bytes  # int32
    block_size: int
    partial: bool
    lora_name: str | None
    plain: bool  # no extra keys: a token walk may use it
    # The hash as the rows dict holds it: the parent links of its children and the masks
    # dict reuse this one bytes object instead of each keeping an equal copy (~48 bytes).
    key: bytes = b""

    @property
    def token_end(self) -> int | None:
        return None if self.token_start is None else self.token_start + len(self.tokens) // 4

    def block_row(self) -> BlockRow:
        return new_tuple(BlockRow, (
            self.parent, self.token_start, tuple(array("i", self.tokens)), self.block_size,
            self.partial,
        ))  # fmt: skip


@dataclass(slots=True)
class Group:
    """One (model, group)'s blocks and holders."""

    rows: dict[bytes, Row] = field(default_factory=dict)
    masks: HolderMasks = field(default_factory=Masks)  # hash -> holder-id bits
    counts: dict[tuple[bytes, int], int] = field(default_factory=dict)  # refcounts above 1
    # parent -> its child's hash, or a list when it has several (most have one)
    children: dict[bytes | None, bytes | list[bytes]] = field(default_factory=dict)

    def canon(self, block_hash: bytes) -> bytes:
        """The hash object the group already holds for ``block_hash`` (else itself)."""
        row = self.rows.get(block_hash)
        return row.key if row is not None else block_hash

    def add_row(self, block_hash: bytes, row: Row) -> None:
        old = self.rows.get(block_hash)
        block_hash = row.key = old.key if old is not None else block_hash
        if row.parent is not None:
            parent = self.rows.get(row.parent)
            if parent is not None:
                row.parent = parent.key
        row.token_start = position(row.token_start)
        self.rows[block_hash] = row
        self.masks.set_end(block_hash, row.token_end or 0)
        if old is not None and old.parent == row.parent:
            return
        if old is not None:
            self._unlink(old.parent, block_hash)
        kids = self.children.get(row.parent)
        if kids is None:
            self.children[row.parent] = block_hash
        elif isinstance(kids, list):
            kids.append(block_hash)
        else:
            self.children[row.parent] = [kids, block_hash]

    def end_of(self, block_hash: bytes) -> int:
        """The block's token end (0: not known), as a block-granularity match reports it."""
        row = self.rows.get(block_hash)
        return (row.token_end or 0) if row is not None else 0

    def child_hashes(self, parent: bytes | None) -> list[bytes]:
        kids = self.children.get(parent)
        if kids is None:
            return []
        return kids if isinstance(kids, list) else [kids]

    def _unlink(self, parent: bytes | None, block_hash: bytes) -> None:
        kids = self.children.get(parent)
        if kids == block_hash:
            del self.children[parent]
        elif isinstance(kids, list) and block_hash in kids:
            kids.remove(block_hash)


class RouterStore(StagedStore):
    """The router's in-memory index (see the module docstring). One writer at a time; the
    RouterIndex serializes writes and lookups with its lock."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: dict[GroupKey, HeldSpec] = {}
        self.groups: dict[GroupKey, Group] = {}
        self.holder_ids: dict[Holder, int] = {}
        self.holders: list[Holder] = []
        self.sources: dict[SourceKey, SourceState] = {}
        self.lives: dict[str, SourceLife] = {}

    # ------------------------------------------------------------------ building
    def group(self, key: GroupKey) -> Group:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = Group()
        return g

    def holder_id(self, holder: Holder) -> int:
        hid = self.holder_ids.get(holder)
        if hid is None:
            hid = self.holder_ids[holder] = len(self.holders)
            self.holders.append(holder)
        return hid

    def hold(self, key: ResidencyKey, refcount: int) -> None:
        """Set one residency's reference count (0: it ends)."""
        g = self.group(key[:2])  # type: ignore[arg-type]  # (model, group_idx): a GroupKey's equal
        hid = self.holder_id(key[3:])
        h = g.canon(key.block_hash)
        if refcount > 0:
            if g.masks.set_bit(h, hid):
                g.masks.set_end(h, g.end_of(h))
            if refcount > 1:
                g.counts[(h, hid)] = refcount
            else:
                g.counts.pop((h, hid), None)
        else:
            g.masks.clear_bit(h, hid)
            g.counts.pop((h, hid), None)

    def refcount(self, key: ResidencyKey) -> int:
        g: Group | None = self.groups.get(key[:2])  # type: ignore[call-overload]
        hid = self.holder_ids.get(key[3:])
        if g is None or hid is None or not g.masks.has_bit(key.block_hash, hid):
            return 0
        return g.counts.get((key.block_hash, hid), 1)

    # ------------------------------------------------------------------ IndexStore

    def load(self, needs: Needs) -> Snapshot:
        return Snapshot(
            self.specs, _Blocks(self), _Residencies(self), _Held(self), self.sources, self.lives,
            history=False,
        )  # fmt: skip

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
        new = write.row
        old = g.rows.get(key.block_hash)
        plain = write.extra_keys is None
        if old is None:
            g.add_row(key.block_hash, _row(new, write.lora_name, plain))
            return
        known = old.block_row()
        lora = old.lora_name if old.lora_name is not None else write.lora_name
        if known.placeholder or upgrades(known, new):
            g.add_row(key.block_hash, _row(new, lora, old.plain and plain))
        else:
            old.lora_name, old.plain = lora, old.plain and plain


def _row(r: BlockRow, lora: str | None, plain: bool) -> Row:
    return Row(
        r.parent_hash, r.token_start, pack(r.token_ids), r.block_size, r.partial, lora, plain
    )


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
        row = g.rows.get(key[2]) if g is not None else None
        return row.block_row() if row is not None else default

    def __iter__(self) -> Iterator[BlockKey]:
        for (model, group), g in self.store.groups.items():
            for h in g.rows:
                yield BlockKey(model, group, h)

    def __len__(self) -> int:
        return sum(len(g.rows) for g in self.store.groups.values())


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
            for h, mask in g.masks.items():
                for hid, (instance, medium, own) in enumerate(store.holders):
                    if (mask >> hid) & 1:
                        yield ResidencyKey(model, group, h, instance, medium, own)

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
    def __init__(self, group: Group, hid: int) -> None:
        self.group, self.hid = group, hid

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.group.masks.held_by(self.hid))

    def __contains__(self, h: object) -> bool:
        return isinstance(h, bytes) and self.group.masks.has_bit(h, self.hid)

    def __len__(self) -> int:
        return sum(1 for _ in self)
