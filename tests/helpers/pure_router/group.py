"""The router group's pure-Python twin: :class:`PureGroup`, the reference implementation
of the compiled core's ``Group`` (rust/src/group.rs), which the unit tests, the fuzzers and
the lane's differential tests hold the core to. The product runs the core alone
(serving/router/groups.py); this module lives with the tests.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.serving.router.groups import BlockFields
from tests.helpers.pure_router import event_runs
from tests.helpers.pure_router.dynamo import DynamoWalk, PureDynamoSlots
from tests.helpers.pure_router.masks import MaskDict, bits

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
    """One block's content as the pure group keeps it."""

    parent: bytes | None
    token_start: int | None
    tokens: bytes  # int32
    block_size: int
    partial: bool
    lora_name: str | None
    plain: bool  # no extra keys (a first block: or only a cache salt): a token walk may use it
    salt: str | None = None  # a first block's cache salt: the walk of that salt starts here
    # The hash as the rows dict holds it: the parent links of its children and the masks
    # dict reuse this one bytes object instead of each keeping an equal copy (~48 bytes).
    key: bytes = b""

    @property
    def token_end(self) -> int | None:
        return None if self.token_start is None else self.token_start + len(self.tokens) // 4


class PureGroup(DynamoWalk):
    """One (model, group)'s blocks and holders in pure Python (see
    :class:`~kvledger.serving.router.groups.BlockGroup`)."""

    copies_hashes = False  # it keeps the hash objects it is given

    @staticmethod
    def new_slots() -> PureDynamoSlots:
        return PureDynamoSlots()

    def __init__(self) -> None:
        self.rows: dict[bytes, Row] = {}
        self.masks = MaskDict()  # hash -> holder-id bits
        self.counts: dict[tuple[bytes, int], int] = {}  # refcounts above 1
        # parent -> its child's hash, or a list when it has several (most have one)
        self.children: dict[bytes | None, bytes | list[bytes]] = {}
        self.dynamo = False  # whether dynamo_levels answers (see enable_dynamo)
        self.clock = 0  # what stores and holders stamp (see set_clock)
        self.seen: dict[bytes, int] = {}  # when each row was last stored or held

    def canon(self, block_hash: bytes) -> bytes:
        """The hash object the group already holds for ``block_hash`` (else itself)."""
        row = self.rows.get(block_hash)
        return row.key if row is not None else block_hash

    def add_row(
        self, key: bytes, parent: bytes | None, token_start: int | None,
        tokens: Sequence[int], block_size: int, partial: bool, lora_name: str | None,
        plain: bool, salt: str | None = None,
    ) -> None:  # fmt: skip
        self._add(key, Row(parent, token_start, pack(tokens), block_size, partial, lora_name,
                           plain, salt if parent is None else None))  # fmt: skip

    def _add(self, block_hash: bytes, row: Row) -> None:
        old = self.rows.get(block_hash)
        block_hash = row.key = old.key if old is not None else block_hash
        if row.parent is not None:
            parent = self.rows.get(row.parent)
            if parent is not None:
                row.parent = parent.key
        row.token_start = position(row.token_start)
        self.rows[block_hash] = row
        self.seen[block_hash] = self.clock
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

    def row(self, key: bytes) -> BlockFields | None:
        r = self.rows.get(key)
        if r is None:
            return None
        return (r.parent, r.token_start, tuple(array("i", r.tokens)), r.block_size, r.partial)

    def meta(self, key: bytes) -> tuple[str | None, bool, str | None] | None:
        r = self.rows.get(key)
        return None if r is None else (r.lora_name, r.plain, r.salt)

    def set_meta(
        self, key: bytes, lora_name: str | None, plain: bool, salt: str | None = None
    ) -> None:
        r = self.rows.get(key)
        if r is not None:
            r.lora_name, r.plain = lora_name, plain
            r.salt = salt if r.parent is None else None

    def hold(self, key: bytes, hid: int, refcount: int) -> None:
        h = self.canon(key)
        if h in self.rows:
            self.seen[h] = self.clock
        if refcount > 0:
            if self.masks.set_bit(h, hid):
                self.masks.set_end(h, self.end_of(h))
            if refcount > 1:
                self.counts[(h, hid)] = refcount
            else:
                self.counts.pop((h, hid), None)
        else:
            self.masks.clear_bit(h, hid)
            self.counts.pop((h, hid), None)

    def store_run(
        self, hashes: Sequence[bytes], parent: bytes | None, token_start: int | None,
        tokens: Sequence[int], block_size: int, partial: bool, lora_name: str | None,
        hid: int, reports: bool,
    ) -> int | None:  # fmt: skip
        return event_runs.store_run(
            self, hashes, parent, token_start, tokens, block_size, partial, lora_name, hid,
            reports,
        )  # fmt: skip

    def release_run(self, hashes: Sequence[bytes], hid: int) -> int:
        return event_runs.release_run(self, hashes, hid)

    def refcount(self, key: bytes, hid: int) -> int:
        if not self.masks.has_bit(key, hid):
            return 0
        return self.counts.get((key, hid), 1)

    def held_by(self, hid: int) -> list[bytes]:
        return self.masks.held_by(hid)

    def residencies(self) -> list[tuple[bytes, int, int]]:
        return [
            (h, hid, self.counts.get((h, hid), 1))
            for h, mask in self.masks.items()
            for hid in bits(mask)
        ]

    def hashes(self) -> list[bytes]:
        return list(self.rows)

    def end_of(self, key: bytes) -> int:
        """The block's token end (0: not known), as a block-granularity match reports it."""
        row = self.rows.get(key)
        return (row.token_end or 0) if row is not None else 0

    def runs(self, hashes: Sequence[bytes]) -> list[tuple[int, int, int]]:
        return self.masks.runs(hashes)

    def runs_covered(self, hashes: Sequence[bytes], ratio: int) -> list[tuple[int, int]]:
        return self.masks.runs_covered(hashes, ratio)

    def match_tokens(
        self, tokens: Sequence[int], block_size: int, hash_block_size: int,
        lora_name: str | None, salt: str | None = None,
    ) -> list[tuple[int, int, int]]:  # fmt: skip
        """The token walk of ``held_tokens``: full blocks from the start (the first under
        ``salt``, a cache salt), then partial tails."""
        bs, hbs, lora = block_size, hash_block_size, lora_name
        if bs <= 0:
            return []
        levels: list[list[bytes]] = []
        level: list[bytes | None] = [None]
        i = 0
        while True:  # chain level i + 1: children of level i holding the next bs tokens
            if i > 0 and (i + 1) * bs > len(tokens):
                break
            found = self._level(level, tokens[i * bs : (i + 1) * bs], bs, False, lora, salt)
            if not found:
                break
            levels.append(found)
            level, i = list(found), i + 1
        full = len(levels)
        pos = full * bs
        # Every block of the last full level is a parent of the tails.
        parents: list[bytes | None] = list(levels[-1]) if levels else [None]
        while hbs > 0 and pos + hbs <= len(tokens):
            found = self._level(parents, tokens[pos : pos + hbs], hbs, True, lora, salt)
            if not found:
                break
            levels.append(found)
            parents, pos = list(found), pos + hbs
        return [(hid, min(b, full), t) for hid, b, t in self.masks.level_runs(levels)]

    def held_path(
        self, tokens: Sequence[int], block_size: int, lora_name: str | None, hid: int,
        salt: str | None = None,
    ) -> list[bytes]:  # fmt: skip
        """The hashes ``hid`` holds down the prompt's full blocks from the start, as the
        token walk finds them, to the first level it holds none of (where a level has
        several rows it holds, the walk goes on under each; the path is the chain up from
        the first, in hash order, of the deepest level)."""
        bs = block_size
        if bs <= 0:
            return []
        parents: list[bytes | None] = [None]
        depth = 0
        for i in range(len(tokens) // bs):
            found = self._level(parents, tokens[i * bs : (i + 1) * bs], bs, False, lora_name,
                                salt)  # fmt: skip
            held = [h for h in found if self.refcount(h, hid) > 0]
            if not held:
                break
            parents, depth = list(held), depth + 1
        path: list[bytes] = []
        at = parents[0]
        for _ in range(depth):
            assert at is not None
            path.append(at)
            at = self.rows[at].parent
        return path[::-1]

    def _level(
        self, parents: list[bytes | None], tokens: Sequence[int], size: int, partial: bool,
        lora: str | None, salt: str | None,
    ) -> list[bytes]:  # fmt: skip
        """The children of ``parents`` holding exactly ``tokens``, sorted."""
        want = pack(tokens)
        return sorted(
            h for parent in parents for h in self._child_hashes(parent)
            if self._fits(h, want, size, partial, lora, parent is None, salt)
        )  # fmt: skip

    def _fits(
        self, h: bytes, want: bytes, size: int, partial: bool, lora: str | None, root: bool,
        salt: str | None,
    ) -> bool:  # fmt: skip
        row = self.rows[h]
        return (
            row.partial == partial
            and row.block_size == size
            and row.tokens == want
            and row.lora_name == lora
            and row.plain
            and (row.parent is None) == root
            and row.salt == (salt if root else None)
        )

    def set_clock(self, now: int) -> None:
        """The time (whole seconds, in [0, 2**32)) that stores and holders from now on
        stamp on the blocks they touch."""
        if not 0 <= now < 1 << 32:
            raise OverflowError(f"a clock time is in [0, 2**32), not {now}")
        self.clock = now

    def expire(self, cutoff: int) -> int:
        """Drop the blocks no one holds, no block names as its parent, and nothing touched
        before ``cutoff``, each dropped block's parent tried next; how many went."""
        if not 0 <= cutoff < 1 << 32:
            raise OverflowError(f"a clock time is in [0, 2**32), not {cutoff}")
        dropped = 0
        for h in list(self.rows):
            at: bytes | None = h
            while at is not None:
                row = self.rows.get(at)
                if row is None or at in self.masks or self._child_hashes(at):
                    break
                if self.seen[at] >= cutoff:
                    break
                del self.rows[at], self.seen[at]
                self._unlink(row.parent, at)
                dropped += 1
                at = row.parent
        return dropped

    def expire_some(self, cutoff: int, rows: int) -> tuple[int, bool]:
        """:meth:`expire` a slice of rows at a time, as the compiled core does; this twin
        does the whole pass at once (it keeps no row order): (dropped, True)."""
        return self.expire(cutoff), True

    def __len__(self) -> int:
        return len(self.rows)

    def _child_hashes(self, parent: bytes | None) -> list[bytes]:
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
