"""A source's events in their wire form, checked before any of them is numbered or produced.

vLLM's events (an embedded engine's objects, a relay's decoded structs) take the vLLM
adapter's mapping (:mod:`.vllm`), which says why an event is refused (an int beyond the
contract's range included). Where the codec frames the current schema, a store or removal
is then written once, here, as the bytes of its envelope's event branch; :func:`frame` puts
the envelope around them when it is numbered.

A whole batch is prepared before any of it is produced: an event that cannot be read
refuses its batch, and no batch is half published for that. A store too large for one
message (a prompt of hundreds of thousands of tokens) leaves as several stores, each block's
parent the one before it, as the contract's chains allow; a single block too large for one
message refuses its batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import Any

from kvledger.producer.vllm import VllmEventError, fit_to_spec, from_vllm_event
from kvledger.schemas.codec import Codec, zigzag
from kvledger.schemas.events import (
    BlockRemoved,
    BlockStored,
    Envelope,
    GroupSpec,
    KVEvent,
    group_of,
    with_int64_hashes,
)

# A vLLM event as the bytes of its envelope's event branch (framed when produced): its type
# name (BlockStored or BlockRemoved), its group, the bytes. kvledger's events are never
# tuples.
Prepared = tuple[str, int, bytes]
_LONG = 1 << 63


def frame(head: bytes, seq: int, time_ms: int, body: bytes, engine_seq: int | None) -> bytes:
    """The message of a prepared event: the envelope head (:meth:`Codec.envelope_head`),
    its sequence number and time, the event branch, the engine's batch number (a union of
    null and long)."""
    if not all(-_LONG <= n < _LONG for n in (seq, time_ms, engine_seq or 0)):
        raise ValueError(f"seq {seq}, time {time_ms} or engine_seq {engine_seq} past an Avro long")
    tail = b"\x00" if engine_seq is None else b"\x02" + zigzag(engine_seq)
    return b"".join((head, zigzag(seq), zigzag(time_ms), body, tail))


class WireForm:
    """One source's rules for its events on the wire: hashes whole (``digest``) or in vLLM's
    int64 form, and its groups' announced specs (a vLLM store whose size is its group's hash
    size is a partial recurrent tail). ``codec``: the one the events are written with (the
    mapped ones are tried with it); ``max_bytes``: the most an event may take in its
    message (the topic's limit less the envelope's other fields), None: unbounded."""

    def __init__(
        self, digest: bool, codec: Codec | None = None, max_bytes: int | None = None
    ) -> None:
        self.digest = digest
        self._codec = codec
        self.max_bytes = max_bytes
        self.specs: dict[int, GroupSpec] = {}
        # Stores and removals leave here as their event branch's bytes (see frame()).
        self.frames = codec is not None and codec.frames_current

    def announce(self, spec: GroupSpec) -> None:
        self.specs[spec.group_idx] = spec

    def hashes(self, event: KVEvent) -> KVEvent:
        """A store or removal with its hashes in the source's form; other events as they are."""
        if self.digest or not isinstance(event, BlockStored | BlockRemoved):
            return event
        return with_int64_hashes(event)

    def prepare(self, events: Iterable[Any]) -> list[Prepared | KVEvent]:
        """vLLM events (objects with vLLM's names, or kvledger events already mapped from
        them) in their wire form; raises :class:`~.vllm.VllmEventError` for one that cannot
        be read, or for a block too large for any message."""
        out: list[Prepared | KVEvent] = []
        for item in events:
            event = item if isinstance(item, KVEvent) else from_vllm_event(item)
            event = self.hashes(fit_to_spec(event, self.specs.get(group_of(event))))
            written, size = self._written(event)
            if self.max_bytes is not None and size > self.max_bytes:
                out += self._split(event, size)
            else:
                out.append(written)
        return out

    def _split(self, event: KVEvent, size: int) -> list[Prepared | KVEvent]:
        """An event over ``max_bytes`` as several stores that each fit (halved until they
        do), or :class:`~.vllm.VllmEventError` when it cannot be split that far."""
        if not isinstance(event, BlockStored) or len(event.block_hashes) < 2:
            raise VllmEventError(
                f"{type(event).__name__} of {size} bytes is larger than a message may be "
                f"({self.max_bytes} bytes) and holds no run of blocks to split"
            )
        out: list[Prepared | KVEvent] = []
        for part in split_store(event, 2):
            written, part_size = self._written(part)
            if part_size > (self.max_bytes or 0):
                out += self._split(part, part_size)
            else:
                out.append(written)
        return out

    def _written(self, event: KVEvent) -> tuple[Prepared | KVEvent, int]:
        """A mapped event in its wire form, written once, here: a store or removal as its
        branch's bytes where this source frames messages, any other event as it is; and
        how many bytes it takes in its message (0 where there is no codec).
        One the contract cannot carry (an int beyond its Avro type) is refused here, before
        any of its batch is produced, not as it is written."""
        codec = self._codec
        if codec is None:
            return event, 0
        try:
            if self.frames and isinstance(event, BlockStored | BlockRemoved):
                body = codec.event_branch(event)
                return (type(event).__name__, group_of(event), body), len(body)
            size = len(codec.encode(Envelope("", "", 0, 0, 0, 0, event)))
        except (TypeError, ValueError, OverflowError) as exc:
            raise VllmEventError(f"{type(event).__name__}: {exc}") from exc
        return event, size


def split_store(event: BlockStored, parts: int) -> list[BlockStored]:
    """A store of several blocks as ``parts`` stores of consecutive blocks (as even as may
    be), each chained to the one before it: the same blocks, tokens and keys. Block ``i``'s
    tokens are ``token_ids[i * block_size:]`` up to the next block's; a partial tail and the
    look-ahead go with the last part."""
    hashes, per = event.block_hashes, event.block_size
    n = len(hashes)
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    out = []
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        last = k == parts - 1
        out.append(
            dataclasses.replace(
                event,
                block_hashes=hashes[a:b],
                parent_block_hash=event.parent_block_hash if a == 0 else hashes[a - 1],
                token_ids=event.token_ids[a * per :]
                if last
                else event.token_ids[a * per : b * per],
                extra_keys=event.extra_keys[a:b] if event.extra_keys is not None else None,
                token_start=event.token_start + a * per if event.token_start is not None else None,
                partial=event.partial and last,
                lookahead_token_ids=event.lookahead_token_ids if last else None,
            )
        )
    return out
