"""The router's groups: one (model, group)'s blocks and holders, as the router's store keeps
them (:mod:`.store`): the compiled core's ``Group`` (rust/src/group.rs: a lookup by hashes
or by tokens is one native call; kvledger/_core.pyi declares its face). Its pure-Python
twin, the reference the tests and fuzzers hold it to, lives in tests/helpers/pure_router/.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvledger.native import MissingCoreError, missing_core

__all__ = [
    "BlockFields",
    "BlockGroup",
    "Group",
    "MissingCoreError",
    "Run",
    "SlotTable",
    "copies_hashes",
    "dynamo_slots",
]

Run = tuple[int, int, int, int]  # a Dynamo walk's: (slot, blocks on GPU, through CPU, storage)

BlockFields = tuple[bytes | None, int | None, tuple[int, ...], int, bool]


class BlockGroup(Protocol):
    """One (model, group)'s blocks and holders: what the router's store and matches need.
    The compiled core's ``Group`` (rust/src/group.rs); its pure twin answers alike
    (tests/helpers/pure_router/group.py, tests/unit/test_group.py)."""

    def add_row(  # noqa: PLR0913 - the compiled core's call (rust/src/py_group.rs), positional
        self,
        key: bytes,
        parent: bytes | None,
        token_start: int | None,
        tokens: Sequence[int],
        block_size: int,
        partial: bool,
        lora_name: str | None,
        plain: bool,
        salt: str | None = None,
    ) -> None: ...
    def row(self, key: bytes) -> BlockFields | None: ...
    def meta(self, key: bytes) -> tuple[str | None, bool, str | None] | None: ...
    def set_meta(
        self, key: bytes, lora_name: str | None, plain: bool, salt: str | None = None
    ) -> None: ...
    def hold(self, key: bytes, hid: int, refcount: int) -> None: ...
    def store_run(  # noqa: PLR0913 - the compiled core's call (rust/src/py_group.rs), positional
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_start: int | None,
        tokens: Sequence[int],
        block_size: int,
        partial: bool,
        lora_name: str | None,
        hid: int,
        reports: bool,
    ) -> int | None: ...
    def release_run(self, hashes: Sequence[bytes], hid: int) -> int: ...
    def refcount(self, key: bytes, hid: int) -> int: ...
    def held_by(self, hid: int) -> list[bytes]: ...
    def residencies(self) -> list[tuple[bytes, int, int]]: ...
    def hashes(self) -> list[bytes]: ...
    def end_of(self, key: bytes) -> int: ...
    def runs(self, hashes: Sequence[bytes]) -> list[tuple[int, int, int]]: ...
    def runs_covered(self, hashes: Sequence[bytes], ratio: int) -> list[tuple[int, int]]: ...
    def match_tokens(
        self,
        tokens: Sequence[int],
        block_size: int,
        hash_block_size: int,
        lora_name: str | None,
        salt: str | None = None,
    ) -> list[tuple[int, int, int]]: ...
    def held_path(
        self,
        tokens: Sequence[int],
        block_size: int,
        lora_name: str | None,
        hid: int,
        salt: str | None = None,
    ) -> list[bytes]: ...
    def enable_dynamo(self) -> None: ...
    def dynamo_local(self, key: bytes) -> int | None: ...
    def dynamo_levels(self, locals: Sequence[int], block_size: int) -> list[tuple[int, int]]: ...
    def dynamo_runs(
        self, locals: Sequence[int], block_size: int, slots: Sequence[int]
    ) -> list[Run]: ...
    # ``slots``: a SlotTable of the group's kind (``dynamo_slots`` below)
    def dynamo_answer(
        self, locals: Sequence[int], block_size: int, slots: Any, cut: int
    ) -> bytes: ...
    def dynamo_answer_packed(
        self, packed: bytes, block_size: int, seed: int, slots: Any, cut: int
    ) -> bytes: ...
    def set_clock(self, now: int) -> None: ...
    def expire(self, cutoff: int) -> int: ...
    def expire_some(self, cutoff: int, rows: int) -> tuple[int, bool]: ...
    def __len__(self) -> int: ...


class SlotTable(Protocol):
    """What a Dynamo /query answer needs beside the walk (rust/src/dynamo_answer.rs,
    tests/helpers/pure_router/dynamo.py's ``PureDynamoSlots``)."""

    def add_holder(self, slot_tier: int) -> None: ...
    def set_slot(self, slot: int, worker: int, rank: int, seen: int | None) -> None: ...
    def set_seen(self, slot: int, seen: int | None) -> None: ...
    def sizes(self) -> tuple[int, int]: ...


try:
    from kvledger._core import DynamoSlots, Group  # Group: what the router's stores build
except ImportError as exc:  # built without a Rust toolchain: say what to do
    raise missing_core("the router index") from exc


def dynamo_slots(kind: type[BlockGroup]) -> SlotTable:
    """A new slot table for the Dynamo answers of groups of ``kind`` (a kind may bring its
    own: ``kind.new_slots()``)."""
    own = getattr(kind, "new_slots", None)
    return own() if own is not None else DynamoSlots()


def copies_hashes(kind: type[BlockGroup]) -> bool:
    """Whether groups of ``kind`` copy the hash objects they are given (the compiled core's
    do; a kind that keeps them says ``copies_hashes = False``)."""
    return bool(getattr(kind, "copies_hashes", True))
