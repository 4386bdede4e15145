from collections.abc import Callable, Mapping, Sequence
from typing import Any

__version__: str

class MalformedAvroError(ValueError): ...

def decode(program: tuple[Any, ...], data: bytes, offset: int, /) -> tuple[Any, int]: ...
def encode(program: tuple[Any, ...], value: Any, header: bytes, /) -> bytes: ...

_Row = tuple[bytes | None, int | None, tuple[int, ...], int, bool]  # a BlockRow's fields

class BlockRows:
    def __init__(self, known: Mapping[Any, Any], base: BlockRows | None = None, /) -> None: ...
    def store(
        self,
        model: str,
        group: int,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        block_size: int,
        start: int | None,
        parent: bytes | None,
        partial: bool,
        lora_name: str | None,
        extra_keys: Sequence[str | None] | None,
        when_us: int,
        /,
    ) -> str | None: ...
    def token_end(self, model: str, group: int, hash: bytes, /) -> int | None: ...
    def sealed(self) -> BlockRows: ...
    def items(
        self,
    ) -> list[
        tuple[tuple[str, int, bytes], _Row, tuple[str | None, str | None, int, int, bool]]
    ]: ...
    def copy_binary(self, stored: bool | None = None, /) -> bytes | None: ...
    def __len__(self) -> int: ...

def upgrades(known: Sequence[Any], new: Sequence[Any], /) -> bool: ...

_Key = tuple[str, int, bytes, str, str, str]  # a ResidencyKey's fields
_Interval = tuple[int, str | None, int, int, int | None, str | None]

class Residencies:
    def __init__(
        self,
        known: Mapping[Any, Any],
        held: Mapping[Any, Any],
        base: Residencies | None,
        history: bool,
        micros: Callable[[Any], int],
        /,
    ) -> None: ...
    def store(
        self,
        holder: tuple[str, int, str, str, str],
        hashes: Sequence[bytes],
        when_us: int,
        locality: str | None,
        at: tuple[str, int, int],
        reports_reuse: bool,
        /,
    ) -> int: ...
    def remove(
        self,
        holder: tuple[str, int, str, str, str],
        hashes: Sequence[bytes],
        when_us: int,
        locality: str | None,
        at: tuple[str, int, int],
        /,
    ) -> int: ...
    def live(
        self,
        model: str,
        group: int | None,
        instance: str,
        medium: str | None,
        ownership: str | None,
        /,
    ) -> list[_Key]: ...
    def end(
        self,
        keys: Sequence[Sequence[Any]],
        how: str,
        when_us: int,
        at: tuple[str, int, int],
        /,
    ) -> dict[str, int]: ...
    def sealed(self) -> Residencies: ...
    def __len__(self) -> int: ...
    def touched(
        self,
    ) -> list[
        tuple[
            _Key,
            int,
            int,
            bool,
            tuple[str | None, int | None, str, int, int],
            tuple[int, str] | None,
            list[_Interval],
        ]
    ]: ...
    def closes_own(self) -> bool: ...
    def copy_closes(self) -> bytes | None: ...
    def copy_history(self, closed_at_us: int | None, /) -> bytes | None: ...
    def copy_holders(self, existed: bool | None = None, /) -> bytes | None: ...

class DynamoSlots:
    def add_holder(self, slot_tier: int) -> None: ...
    def set_slot(self, slot: int, worker: int, rank: int, seen: int | None) -> None: ...
    def set_seen(self, slot: int, seen: int | None) -> None: ...
    def sizes(self) -> tuple[int, int]: ...

class Group:
    def add_row(
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
        /,
    ) -> None: ...
    def row(
        self, key: bytes, /
    ) -> tuple[bytes | None, int | None, tuple[int, ...], int, bool] | None: ...
    def meta(self, key: bytes, /) -> tuple[str | None, bool, str | None] | None: ...
    def set_meta(
        self, key: bytes, lora_name: str | None, plain: bool, salt: str | None = None, /
    ) -> None: ...
    def hold(self, key: bytes, hid: int, refcount: int, /) -> None: ...
    def store_run(
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
        /,
    ) -> int | None: ...
    def release_run(self, hashes: Sequence[bytes], hid: int, /) -> int: ...
    def refcount(self, key: bytes, hid: int, /) -> int: ...
    def held_by(self, hid: int, /) -> list[bytes]: ...
    def residencies(self) -> list[tuple[bytes, int, int]]: ...
    def hashes(self) -> list[bytes]: ...
    def end_of(self, key: bytes, /) -> int: ...
    def runs(self, hashes: Sequence[bytes], /) -> list[tuple[int, int, int]]: ...
    def runs_covered(self, hashes: Sequence[bytes], ratio: int, /) -> list[tuple[int, int]]: ...
    def match_tokens(
        self,
        tokens: Sequence[int],
        block_size: int,
        hash_block_size: int,
        lora_name: str | None,
        salt: str | None = None,
        /,
    ) -> list[tuple[int, int, int]]: ...
    def held_path(
        self,
        tokens: Sequence[int],
        block_size: int,
        lora_name: str | None,
        hid: int,
        salt: str | None = None,
    ) -> list[bytes]: ...
    def _hash(self, key: bytes, /) -> int: ...
    def enable_dynamo(self) -> None: ...
    def dynamo_local(self, key: bytes) -> int | None: ...
    def dynamo_levels(self, locals: Sequence[int], block_size: int) -> list[tuple[int, int]]: ...
    def dynamo_runs(
        self, locals: Sequence[int], block_size: int, slots: Sequence[int]
    ) -> list[tuple[int, int, int, int]]: ...
    def dynamo_answer(
        self, locals: Sequence[int], block_size: int, slots: DynamoSlots, cut: int
    ) -> bytes: ...
    def dynamo_answer_packed(
        self, packed: bytes, block_size: int, seed: int, slots: DynamoSlots, cut: int
    ) -> bytes: ...
    def set_clock(self, now: int) -> None: ...
    def expire(self, cutoff: int) -> int: ...
    def expire_some(self, cutoff: int, rows: int) -> tuple[int, bool]: ...
    def __len__(self) -> int: ...

def dynamo_block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]: ...
def dynamo_token_query(raw: bytes) -> tuple[str, str, str | None, bytes] | None: ...
def dynamo_packed_hashes(packed: bytes, block_size: int, seed: int) -> list[int]: ...
