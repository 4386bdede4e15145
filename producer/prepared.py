"""A source's events in their wire form, checked before any of them is numbered or produced.

vLLM's events (an embedded engine's objects, a relay's decoded structs) take the compiled
pass (``producer/_vllm.c``: the object's attributes straight to the Avro bytes of the
envelope's event branch) wherever it takes the event as it is; a relay's events still in
msgpack take its reader (``producer/_vllm_packed.h``) or, where it declines one, go back
to be decoded whole. The rest take the vLLM adapter's mapping (:mod:`.vllm`), which writes
the same bytes through the codec, or says why the event is refused (an int beyond the
contract's range included); tests/unit/test_vllm_compiled.py holds them to the same answers.

A whole batch is prepared before any of it is produced: an event that cannot be read
refuses its batch, and no batch is half published for that.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from kvledger.producer.vllm import VllmEventError, fit_to_spec, from_vllm_event, kind_of
from kvledger.schemas.codec import EVENT_CLASSES, Codec
from kvledger.schemas.events import (
    BlockRemoved,
    BlockStored,
    Envelope,
    GroupSpec,
    KVEvent,
    group_of,
    with_int64_hashes,
)

try:
    from kvledger.producer import _vllm
except ImportError:  # pragma: no cover - built where a C compiler is (setup.py)
    _vllm = None  # type: ignore[assignment]

COMPILED = _vllm is not None
# A vLLM event as the bytes of its envelope's event branch (framed when produced): its type
# name (BlockStored or BlockRemoved), its group, the bytes. A plain tuple, as the compiled
# pass makes it; kvledger's events are never tuples.
Prepared = tuple[str, int, bytes]
_KIND_CODES = {"BlockStored": 0, "BlockRemoved": 1}  # the compiled pass's kinds
_NOT_COMPILED = -1


class NotCompiledError(Exception):
    """A packed batch holds an event the compiled pass does not take: decode it whole."""


class WireForm:
    """One source's rules for its events on the wire: hashes whole (``digest``) or in vLLM's
    int64 form, and its groups' announced specs (a vLLM store whose size is its group's hash
    size is a partial recurrent tail). ``compiled``: vLLM's events take the compiled pass;
    ``codec``: the one the events are written with (the mapped ones are tried with it)."""

    def __init__(self, digest: bool, compiled: bool, codec: Codec | None = None) -> None:
        self.digest = digest
        self._codec = codec
        self.specs: dict[int, GroupSpec] = {}
        self._partial_sizes: dict[int, int] = {}  # the compiled pass's view of the specs
        # Each class seen: its compiled kind, or _NOT_COMPILED (kvledger's own among them).
        self._codes: dict[type, int] = dict.fromkeys(EVENT_CLASSES, _NOT_COMPILED)
        self._body = _vllm.body if compiled and _vllm is not None else None
        self.compiled = self._body is not None
        # frame(head, seq, time_ms, body, engine_seq): the message of a Prepared event;
        # produce(...): a run of them framed and produced; publish(events, produce, topic,
        # head, time_ms, engine_seq, seqs, keys, counts): one batch of vLLM's objects
        # prepared whole, then framed and produced from its start, in one call: (items,
        # done) with items[:done] produced, or None, nothing produced, where the pass leaves
        # any of its events (the batch takes prepare) (producer/_vllm.c).
        self.frame = _vllm.frame if self._body is not None else _uncompiled
        self.produce = _vllm.produce if self._body is not None else _uncompiled
        self.publish = (
            functools.partial(_vllm.publish, digest, self._partial_sizes, self._codes)
            if self._body is not None
            else _uncompiled
        )
        # publish_packed(events, produce, ...): the same for a relay's batch still in
        # msgpack (each event a msgspec.Raw).
        self.publish_packed = (
            functools.partial(_vllm.publish_packed, digest, self._partial_sizes)
            if self._body is not None
            else _uncompiled
        )

    def announce(self, spec: GroupSpec) -> None:
        self.specs[spec.group_idx] = spec
        if spec.hash_block_size != spec.block_size:
            self._partial_sizes[spec.group_idx] = spec.hash_block_size
        else:
            self._partial_sizes.pop(spec.group_idx, None)

    def hashes(self, event: KVEvent) -> KVEvent:
        """A store or removal with its hashes in the source's form; other events as they are."""
        if self.digest or not isinstance(event, BlockStored | BlockRemoved):
            return event
        return with_int64_hashes(event)

    def prepare(self, events: Iterable[Any], packed: bool = False) -> list[Prepared | KVEvent]:
        """vLLM events (objects with vLLM's names, or kvledger events already mapped from
        them) in their wire form; raises :class:`~.vllm.VllmEventError` for one that cannot
        be read. ``packed``: each event is still its msgpack (msgspec.Raw, a relay's); one
        the compiled pass does not take raises :class:`NotCompiledError`."""
        if packed:
            return self._packed(events)
        if self._body is not None and _vllm is not None:
            listed = events if type(events) is list else list(events)
            got = _vllm.prepare(listed, self.digest, self._partial_sizes, self._codes)
            if got is not None:  # the compiled pass over the whole list
                items, left = got
                if left:  # what it left: a class not seen before, or a field it does not take
                    for i, item in enumerate(items):
                        if type(item) is not tuple:
                            items[i] = self._one(item)
                return items
            events = listed
        return [self._one(item) for item in events]

    def _one(self, item: Any) -> Prepared | KVEvent:
        code = self._codes.get(type(item))
        if code is None:
            code = self._codes[type(item)] = _KIND_CODES.get(kind_of(item), _NOT_COMPILED)
        if code != _NOT_COMPILED and self._body is not None:
            got = self._body(code, item, self.digest, self._partial_sizes)
            if got is not None:
                return got
        event = item if isinstance(item, KVEvent) else from_vllm_event(item)
        return self._written(self.hashes(fit_to_spec(event, self.specs.get(group_of(event)))))

    def _packed(self, events: Iterable[Any]) -> list[Prepared | KVEvent]:
        if self._body is None or _vllm is None:
            raise NotCompiledError("the compiled pass was not built")
        read, digest, partial = _vllm.event, self.digest, self._partial_sizes
        out: list[Prepared | KVEvent] = []
        for packed in events:
            got = read(packed, digest, partial)
            if got is None:
                raise NotCompiledError("an event the compiled pass does not take")
            out.append(got)
        return out

    def _written(self, event: KVEvent) -> Prepared | KVEvent:
        """A mapped event in its wire form, written once, here: a store or removal as its
        branch's bytes where the compiled pass frames messages, any other event as it is.
        One the contract cannot carry (an int beyond its Avro type) is refused here, before
        any of its batch is produced, not as it is written."""
        codec = self._codec
        if codec is None:
            return event
        try:
            if (
                self._body is not None
                and codec.frames_current
                and isinstance(event, BlockStored | BlockRemoved)
            ):
                return (type(event).__name__, group_of(event), codec.event_branch(event))
            codec.encode(Envelope("", "", 0, 0, 0, 0, event))
        except (TypeError, ValueError, OverflowError) as exc:
            raise VllmEventError(f"{type(event).__name__}: {exc}") from exc
        return event


def _uncompiled(*args: Any) -> Any:
    raise RuntimeError("only the compiled pass prepares events to frame")
