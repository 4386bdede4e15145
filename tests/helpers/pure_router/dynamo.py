"""The pure twin of the compiled core's Dynamo view of a group (rust/src/group/dynamo.rs,
rust/src/dynamo_answer.rs): :class:`DynamoWalk`, the Dynamo methods of
:class:`~tests.helpers.pure_router.group.PureGroup` (each block's Dynamo local hash, a walk
by those hashes, and a /query answer from it), and :class:`PureDynamoSlots`, what such an
answer needs beside the walk. They answer as the core does (tests/unit/test_dynamo_api.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvledger.schemas.dynamo import dynamo_block_hashes, packed_block_hashes
from tests.helpers.pure_router.masks import MaskDict, bits

if TYPE_CHECKING:
    from tests.helpers.pure_router.group import Row

Run = tuple[int, int, int, int]  # (slot, blocks on GPU, through CPU, through storage)


class PureDynamoSlots:
    """What a /query answer needs beside the walk (rust/src/dynamo_answer.rs
    ``DynamoSlots``): each holder's ``slot * 3 + tier`` (negative: a tier Dynamo has not),
    and each slot's Dynamo worker id, data-parallel rank and last sight (µs since the epoch;
    None: closed or unknown, never live)."""

    def __init__(self) -> None:
        self.holders: list[int] = []
        self.workers: list[tuple[int, int]] = []
        self.seen: list[int | None] = []

    def add_holder(self, slot_tier: int) -> None:
        self.holders.append(slot_tier)

    def set_slot(self, slot: int, worker: int, rank: int, seen: int | None) -> None:
        if not 0 <= slot <= len(self.workers):
            raise IndexError("slots are added in order")
        if slot == len(self.workers):
            self.workers.append((worker, rank))
            self.seen.append(seen)
        else:
            self.workers[slot], self.seen[slot] = (worker, rank), seen

    def set_seen(self, slot: int, seen: int | None) -> None:
        if not 0 <= slot < len(self.seen):
            raise IndexError("no such slot")
        self.seen[slot] = seen

    def sizes(self) -> tuple[int, int]:
        return len(self.holders), len(self.workers)


def answer(runs: Sequence[Run], slots: PureDynamoSlots, block_size: int, cut: int) -> bytes:
    """The /query answer (JSON) of ``runs`` for blocks of ``block_size`` tokens, scoring the
    slots seen at or after ``cut``: workers in the order their first slot comes, a worker's
    figures the best of its ranks'."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for slot, on_gpu, on_cpu, on_disk in runs:
        seen = slots.seen[slot] if slot < len(slots.seen) else None
        if seen is None or seen < cut:
            continue
        worker, rank_ = slots.workers[slot]
        wid, rank = str(worker), str(rank_)
        gt, ct, dt = on_gpu * block_size, on_cpu * block_size, on_disk * block_size
        if gt:  # two sources that are one worker's one rank ("a", "a-dp0"): the better
            ranks = scores.setdefault(wid, {})
            ranks[rank] = max(ranks.get(rank, 0), gt)
        s = instances.get(wid)
        if s is None:
            instances[wid] = {"longest_matched": dt, "gpu": gt, "dp": {rank: gt}, "cpu": ct,
                              "disk": dt}  # fmt: skip
        else:
            s["dp"][rank] = max(s["dp"].get(rank, 0), gt)
            s["gpu"], s["cpu"] = max(s["gpu"], gt), max(s["cpu"], ct)
            s["disk"] = s["longest_matched"] = max(s["disk"], dt)
    return msgspec.json.encode({"scores": scores, "frequencies": [], "instances": instances})


class DynamoWalk:
    """The Dynamo methods of the pure group (a mixin: the group keeps ``rows``, ``masks``
    and the parent links)."""

    rows: dict[bytes, Row]
    masks: MaskDict
    dynamo: bool
    _child_hashes: Callable[[bytes | None], list[bytes]]

    def enable_dynamo(self) -> None:
        """Answer :meth:`dynamo_levels` from now on (the compiled core keeps a table for
        it from here; this twin computes each child's hash as it walks)."""
        self.dynamo = True

    def dynamo_local(self, key: bytes) -> int | None:
        """The block's Dynamo local hash (None: not a full plain block with content)."""
        row = self.rows.get(key)
        if row is None or not row.plain or row.salt is not None or row.partial:
            return None
        if row.block_size <= 0:
            return None
        if len(row.tokens) != 4 * row.block_size:  # int32 tokens: a full block
            return None
        tokens = array("i", row.tokens).tolist()
        return dynamo_block_hashes(tokens, row.block_size, row.lora_name)[0]

    def dynamo_levels(self, locals: Sequence[int], block_size: int) -> list[tuple[int, int]]:
        """The walk of a prompt's Dynamo local hashes from the root: level i holds the
        blocks of hash ``locals[i]`` and size ``block_size`` under a block of level i - 1.
        For every holder of any level, the levels it holds as an int's bits."""
        if not self.dynamo:
            return []
        held: dict[int, int] = {}
        parents: list[bytes | None] = [None]
        for i, local in enumerate(locals):
            level = [
                h for p in parents for h in self._child_hashes(p)
                if self.rows[h].block_size == block_size and self.dynamo_local(h) == local
            ]  # fmt: skip
            if not level:
                break
            for h in level:
                for hid in bits(self.masks.mask(h)):
                    held[hid] = held.get(hid, 0) | 1 << i
            parents = list(level)
        return sorted(held.items())

    def dynamo_runs(
        self, locals: Sequence[int], block_size: int, slots: Sequence[int]
    ) -> list[Run]:
        """:meth:`dynamo_levels` summed up per slot: ``slots[hid]`` is a holder's
        ``slot * 3 + tier`` (0 GPU, 1 CPU, 2 storage; negative or absent: left out). Per
        slot with a match, in slot order: (slot, blocks on GPU from the root, then on
        through CPU, then through storage)."""
        tiers: dict[int, list[int]] = {}
        for hid, held in self.dynamo_levels(locals, block_size):
            s = slots[hid] if hid < len(slots) else -1
            if s >= 0:
                tiers.setdefault(s // 3, [0, 0, 0])[s % 3] |= held
        out = []
        for slot in sorted(tiers):
            gpu, cpu, disk = tiers[slot]
            on_gpu = _run_from(gpu, 0)
            on_cpu = on_gpu + _run_from(cpu, on_gpu)
            on_disk = on_cpu + _run_from(disk, on_cpu)
            if on_disk:
                out.append((slot, on_gpu, on_cpu, on_disk))
        return out

    def dynamo_answer(
        self, locals: Sequence[int], block_size: int, slots: PureDynamoSlots, cut: int
    ) -> bytes:
        """Dynamo's /query answer (JSON) of the walk of ``locals``, per ``slots``, scoring
        the slots seen at or after ``cut`` (µs since the epoch)."""
        return answer(self.dynamo_runs(locals, block_size, slots.holders), slots,
                      abs(block_size), cut)  # fmt: skip

    def dynamo_answer_packed(
        self, packed: bytes, block_size: int, seed: int, slots: PureDynamoSlots, cut: int
    ) -> bytes:
        """:meth:`dynamo_answer` of the Dynamo local hashes of token ids packed as u32 LE
        bytes, under ``seed``."""
        locals_ = packed_block_hashes(packed, block_size, seed)  # none for a size <= 0
        return self.dynamo_answer(locals_, block_size, slots, cut)


def _run_from(mask: int, start: int) -> int:
    """How many bits of ``mask`` are set in a row from bit ``start``."""
    rest = mask >> start
    return ((rest + 1) & ~rest).bit_length() - 1
