"""A whole store or removal event applied to one group in one call (the pure twin of
rust/src/group/events.rs), for the router's fast lane (serving/router/lane.py).

Most events a fleet sends store blocks that are new to the group or that another holder
stored already with the same content, or remove blocks a holder holds. For those the index
rules (consumer/core/plan.py) come down to: add the rows that are new, keep the first LoRA
name, one reference more per block (none for a block held already by a source that reports
reuse), or one less. :func:`store_run` does exactly that (a placeholder's blocks keep
whatever their rows hold), and declines, changing nothing, an event where a rule could say
more: a block already stored with other content or position, a hash twice. The caller then
plans that event with the rules.

Written with the methods every :class:`~kvledger.serving.router.groups.BlockGroup` has, so
it is the rules' own reading; the compiled group's ``store_run`` must agree with it on every
input (tests/unit/test_router_lane.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvledger.consumer.core.model import BlockRow

if TYPE_CHECKING:
    from kvledger.serving.router.groups import BlockFields, BlockGroup


def start_after(g: BlockGroup, parent: bytes | None) -> int | None:
    """Where a block after ``parent`` starts when its event says not: 0 at the root, else
    its parent's token end (None: not known)."""
    if parent is None:
        return 0
    row = g.row(parent)
    return BlockRow(*row).token_end if row is not None else None


def store_run(
    g: BlockGroup, hashes: Sequence[bytes], parent: bytes | None, token_start: int | None,
    tokens: Sequence[int], block_size: int, partial: bool, lora_name: str | None, hid: int,
    reports: bool,
) -> int | None:  # fmt: skip
    """Apply a store event for holder ``hid`` (see the module doc): None when declined
    (nothing changed), else how many blocks were a reported reuse."""
    placeholder = block_size == 0 and not tokens  # its blocks keep what their rows hold
    if block_size < 0 or (block_size == 0 and not placeholder):
        return None
    if not hashes or not all(hashes) or parent == b"":
        return None
    if len({*hashes, parent}) != len(hashes) + 1:  # a hash twice, or its own parent
        return None
    start = token_start
    if start is None and not placeholder:
        start = start_after(g, parent)
    tokens = tuple(tokens)
    blocks = []
    above = parent
    for i, h in enumerate(hashes):
        at = start + i * block_size if start is not None else None
        block = (above, at, tokens[i * block_size : (i + 1) * block_size], block_size, partial)
        known = g.row(h)
        if known is not None and not placeholder and tuple(known) != block:
            return None
        blocks.append((h, block, known))
        above = h
    reused = 0
    for h, block, known in blocks:
        if known is None:
            g.add_row(h, *block, lora_name, True, None)
        else:
            _keep(g, h, known, lora_name, placeholder)
        held = g.refcount(h, hid)
        if reports and held > 0:
            reused += 1
        else:
            g.hold(h, hid, held + 1)
    return reused


def _keep(
    g: BlockGroup, h: bytes, known: BlockFields, lora_name: str | None, placeholder: bool
) -> None:
    """A stored row a store names again keeps its content and its first LoRA name; a
    placeholder row a placeholder names is stored again as it is (as the rules merge it:
    its metadata kept, its time touched)."""
    meta = g.meta(h)
    assert meta is not None
    lora = meta[0] if meta[0] is not None else lora_name
    if placeholder and known[3] == 0:
        g.add_row(h, *known, lora, meta[1], meta[2])
    elif lora != meta[0]:
        g.set_meta(h, lora, meta[1], meta[2])


def release_run(g: BlockGroup, hashes: Sequence[bytes], hid: int) -> int:
    """Apply a removal event for holder ``hid``: one reference less per hash; how many
    found none left (a recorded no-op, never a negative count)."""
    noop = 0
    for h in hashes:
        held = g.refcount(h, hid)
        if held == 0:
            noop += 1
        else:
            g.hold(h, hid, held - 1)
    return noop
