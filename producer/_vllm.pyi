from typing import Any

def body(
    kind: int, event: Any, digest: bool, partial: dict[int, int] | None, /
) -> tuple[str, int, bytes] | None: ...
def prepare(
    events: list[Any], digest: bool, partial: dict[int, int] | None, codes: dict[type, int], /
) -> tuple[list[Any], int] | None: ...
def event(
    packed: Any, digest: bool, partial: dict[int, int] | None, /
) -> tuple[str, int, bytes] | None: ...
def frame(head: bytes, seq: int, time_ms: int, body: bytes, engine_seq: int | None, /) -> bytes: ...
def produce(
    produce: Any,
    topic: str,
    head: bytes,
    time_ms: int,
    engine_seq: int | None,
    items: list[Any],
    start: int,
    seqs: dict[int, int],
    keys: dict[int, bytes],
    counts: dict[str, int],
    /,
) -> int: ...
def publish(
    digest: bool,
    partial: dict[int, int] | None,
    codes: dict[type, int],
    events: list[Any],
    produce: Any,
    topic: str,
    head: bytes,
    time_ms: int,
    engine_seq: int | None,
    seqs: dict[int, int],
    keys: dict[int, bytes],
    counts: dict[str, int],
    /,
) -> tuple[list[Any], int] | None: ...
def publish_packed(
    digest: bool,
    partial: dict[int, int] | None,
    events: list[Any],
    produce: Any,
    topic: str,
    head: bytes,
    time_ms: int,
    engine_seq: int | None,
    seqs: dict[int, int],
    keys: dict[int, bytes],
    counts: dict[str, int],
    /,
) -> tuple[list[Any], int] | None: ...
