"""A request trace of Mooncake's shape, read and checked line by line.

One JSON object a line: ``timestamp`` (arrival, ms from the trace's start, never going back),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per block of
``block_tokens`` prompt tokens, the last block possibly partial; equal ids mean equal
content, and an id's meaning includes the ids before it). A bad line is refused with its
number and field (:class:`TraceError`); :func:`check_trace` reads the whole file first, so a
replay never begins on a trace that would stop half-way. Reading streams: a trace larger than
memory is read a line at a time, twice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvledger.schemas.errors import KvledgerError

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MAX_LINE_BYTES = 16 << 20  # one request's line; a longer one is refused, not read whole


class TraceError(KvledgerError, ValueError):
    """A trace line that is not a request of the trace's shape."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the trace."""

    at_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, block_tokens: int) -> tuple[int, ...]:
        """The ids of the prompt's full blocks: the only ones an engine caches."""
        return self.hash_ids[: self.input_length // block_tokens]


@dataclass(frozen=True)
class TraceSummary:
    """What a checked trace holds (its first pass)."""

    path: Path
    requests: int
    span_ms: int
    input_tokens: int
    blocks: int
    distinct_blocks: int

    @property
    def infinite_cache_share(self) -> float:
        """The share of blocks an infinite shared cache would serve (seen before)."""
        return 1 - self.distinct_blocks / self.blocks if self.blocks else 0.0


def _count(path: Path, line: int, record: dict[str, object], name: str) -> int:
    value = record.get(name)
    if value is None:
        raise TraceError(path, line, f"field {name!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, f"field {name!r} must be an integer, not {value!r}")
    if value < 0:
        raise TraceError(path, line, f"field {name!r} is negative ({value})")
    return value


def parse_line(path: Path, line: int, text: str | bytes, block_tokens: int) -> Request:
    """One line as a :class:`Request`, or :class:`TraceError` naming the line and field."""
    try:
        record = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(path, line, f"not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise TraceError(path, line, f"not a JSON object but {type(record).__name__}")
    at = _count(path, line, record, "timestamp")
    tokens = _count(path, line, record, "input_length")
    out = _count(path, line, record, "output_length")
    ids = record.get("hash_ids")
    if ids is None:
        raise TraceError(path, line, "field 'hash_ids' is missing")
    if not isinstance(ids, list):
        raise TraceError(path, line, f"field 'hash_ids' must be a list, not {type(ids).__name__}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 2**63:
            raise TraceError(path, line, f"hash_ids[{i}] must be an integer in [0, 2^63): {h!r}")
    need = math.ceil(tokens / block_tokens)
    if len(ids) < tokens // block_tokens or len(ids) > need:
        raise TraceError(
            path,
            line,
            f"hash_ids has {len(ids)} ids for {tokens} tokens "
            f"(blocks of {block_tokens} tokens: {tokens // block_tokens} to {need})",
        )
    return Request(at, tokens, out, tuple(ids))


def read_trace(path: Path, block_tokens: int = 512) -> Iterator[Request]:
    """The trace's requests in order, a line at a time (blank lines skipped); the first bad
    line raises :class:`TraceError`. Run :func:`check_trace` first to refuse a bad file whole."""
    last = 0
    with path.open("rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(path, number, f"line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            request = parse_line(path, number, raw, block_tokens)
            if request.at_ms < last:
                raise TraceError(
                    path, number, f"field 'timestamp' goes back ({request.at_ms} after {last})"
                )
            last = request.at_ms
            yield request


def check_trace(path: Path, block_tokens: int = 512) -> TraceSummary:
    """Read the whole trace once (streaming) and say what it holds; :class:`TraceError` on
    the first bad line, :class:`FileNotFoundError` when there is no such file."""
    requests = tokens = blocks = 0
    span = 0
    seen: set[int] = set()
    for request in read_trace(path, block_tokens):
        requests += 1
        tokens += request.input_length
        blocks += len(request.hash_ids)
        seen.update(request.hash_ids)
        span = request.at_ms
    if not requests:
        raise TraceError(path, 0, "the trace holds no request")
    return TraceSummary(path, requests, span, tokens, blocks, len(seen))
