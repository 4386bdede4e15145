"""A source's events in their wire form, checked before any of them is numbered or produced.

vLLM's events (an embedded engine's objects, a relay's decoded structs) take the vLLM
adapter's mapping (:mod:`.vllm`), which says why an event is refused (an int beyond the
contract's range included). Where the codec frames the current schema, a store or removal
is then written once, here, as the bytes of its envelope's event branch; :func:`frame` puts
the envelope around them when it is numbered.

A whole batch is prepared before any of it is produced: an event that cannot be read
refuses its batch, and no batch is half published for that.
"""

from __future__ import annotations

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
    mapped ones are tried with it)."""

    def __init__(self, digest: bool, codec: Codec | None = None) -> None:
        self.digest = digest
        self._codec = codec
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
        be read."""
        return [self._one(item) for item in events]

    def _one(self, item: Any) -> Prepared | KVEvent:
        event = item if isinstance(item, KVEvent) else from_vllm_event(item)
        return self._written(self.hashes(fit_to_spec(event, self.specs.get(group_of(event)))))

    def _written(self, event: KVEvent) -> Prepared | KVEvent:
        """A mapped event in its wire form, written once, here: a store or removal as its
        branch's bytes where this source frames messages, any other event as it is.
        One the contract cannot carry (an int beyond its Avro type) is refused here, before
        any of its batch is produced, not as it is written."""
        codec = self._codec
        if codec is None:
            return event
        try:
            if self.frames and isinstance(event, BlockStored | BlockRemoved):
                return (type(event).__name__, group_of(event), codec.event_branch(event))
            codec.encode(Envelope("", "", 0, 0, 0, 0, event))
        except (TypeError, ValueError, OverflowError) as exc:
            raise VllmEventError(f"{type(event).__name__}: {exc}") from exc
        return event
