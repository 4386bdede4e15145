"""The content rules of block rows in plain Python: the oracle the compiled core's
``BlockRows`` (rust/src/plan_rows.rs) is held to, by tests/unit/test_block_rows.py and the
fuzz tests. The planner itself uses the core."""

from __future__ import annotations

from kvledger.consumer.core.model import BlockRow, new_tuple
from kvledger.schemas.events import BlockStored


def explode(event: BlockStored, start: int | None = None) -> list[tuple[bytes, BlockRow]]:
    """One row per hash: hash i covers tokens [start + i*size, +size), parent hash i-1.

    ``start``: the first token's position when the event does not say (None: unknown)."""
    rows = []
    parent = event.parent_block_hash
    size = event.block_size
    if event.token_start is not None:
        start = event.token_start
    tokens = event.token_ids if isinstance(event.token_ids, tuple) else tuple(event.token_ids)
    partial = event.partial
    for i, h in enumerate(event.block_hashes):
        at = start + i * size if start is not None else None
        # (parent_hash, token_start, token_ids, block_size, partial): slices of a tuple
        rows.append(
            (h, new_tuple(BlockRow, (parent, at, tokens[i * size : (i + 1) * size], size, partial)))
        )
        parent = h
    return rows


def conflicts(existing: BlockRow, new: BlockRow) -> str | None:
    """Why ``new`` cannot describe the same hash as ``existing``; None when consistent.

    The same hash may be described at two granularities (a partial tail's hash-size row and
    a full block's row end at the same token): then both must end at the same position and
    agree on the tokens they share (the shorter is a suffix of the longer).
    """
    if existing.placeholder or new.placeholder:
        return None
    if existing.block_size == new.block_size:
        if existing.token_ids != new.token_ids:
            return "same hash announced with different tokens"
        if existing.parent_hash != new.parent_hash:
            return "same hash announced with a different parent"
        if (
            existing.token_start is not None
            and new.token_start is not None
            and existing.token_start != new.token_start
        ):
            return "same hash announced at a different position"
        return None
    if (
        existing.token_end is not None
        and new.token_end is not None
        and existing.token_end != new.token_end
    ):
        return "same hash announced ending at a different position"
    shorter, longer = sorted((existing.token_ids, new.token_ids), key=len)
    if longer[len(longer) - len(shorter) :] != shorter:
        return "same hash announced with different tokens"
    return None


def upgrades(known: BlockRow, new: BlockRow) -> bool:
    """A full-size or real row replaces a placeholder or partial-tail row of the same hash,
    and a row that knows its position replaces one of the same size that does not."""
    if new.placeholder:
        return False
    return (
        known.placeholder
        or (known.partial and not new.partial)
        or (
            known.token_start is None
            and new.token_start is not None
            and known.block_size == new.block_size
            and known.partial == new.partial
        )
    )


class ReferenceRows:
    """One batch's block rows as the planner made them in Python: ``BlockRows``' oracle
    (the same methods, with BlockRows.items()' shape)."""

    def __init__(
        self, known: dict[tuple[str, int, bytes], BlockRow], base: ReferenceRows | None = None
    ) -> None:
        self.known = dict(known)
        if base is not None:  # the batch in flight's rows, as the store will hold them
            self.known.update({key: w[0] for key, w in base.writes.items()})
        self.blocks: dict[tuple[str, int, bytes], BlockRow] = {}  # rows this batch made
        self.writes: dict[tuple[str, int, bytes], list[object]] = {}

    def _known(self, key: tuple[str, int, bytes]) -> BlockRow | None:
        return self.blocks.get(key) or self.known.get(key)

    def token_end(self, model: str, group: int, h: bytes) -> int | None:
        row = self._known((model, group, h))
        return row.token_end if row is not None else None

    def store(
        self, model: str, group: int, hashes: tuple[bytes, ...], tokens: tuple[int, ...],
        size: int, start: int | None, parent: bytes | None, partial: bool,
        lora: str | None, extra: tuple[str | None, ...] | None, when: int,
    ) -> str | None:  # fmt: skip
        event = BlockStored(hashes, parent, tokens, size, None, None, lora, extra, group,
                            partial=partial)  # fmt: skip
        rows = explode(event, start)
        keys = [(model, group, h) for h, _ in rows]
        before = [self._known(k) for k in keys]
        for (h, row), known in zip(rows, before, strict=True):
            if known is not None and (why := conflicts(known, row)) is not None:
                return f"{why}: hash {h.hex()}"
        extra = extra or ()
        for i, ((_, row), key) in enumerate(zip(rows, keys, strict=True)):
            known = self.blocks.get(key) or before[i]
            if known is None or upgrades(known, row):
                self.blocks[key] = known = row
            write = self.writes.get(key)
            if write is None:
                self.writes[key] = [known, lora, extra[i] if i < len(extra) else None,
                                    when, when, key in self.known]  # fmt: skip
                continue
            write[0] = known
            write[1] = write[1] if write[1] is not None else lora
            if write[2] is None and i < len(extra):
                write[2] = extra[i]
            write[3], write[4] = min(write[3], when), max(write[4], when)  # type: ignore[call-overload]
        return None

    def items(self) -> list[tuple[object, ...]]:
        return [(key, tuple(w[0]), tuple(w[1:])) for key, w in self.writes.items()]  # type: ignore[arg-type]
