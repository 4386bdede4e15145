"""Dynamo worker ids for kvledger's sources, and Dynamo's registrations (the module
docstring of serving/lookup/dynamo.py says how sources map to workers)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

_SUFFIX = re.compile(r"(\d+)$")
_RANK = re.compile(r"^(.+)-dp(\d{1,6})$")


def hashed_worker_id(name: str) -> int:
    """A source's worker id when its name ends in no integer of its own: 63 bits of the
    SHA-256 of its name (stable across restarts and processes)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 1


class Workers:
    """Worker ids for kvledger's sources (see the module docstring), and registrations.

    Ids are given on first sight, in sorted order of the sources present at once (a query
    sees every source that holds blocks), so a source keeps its id for the life of the
    process. ``/register`` may pin an id to a source not seen yet (or to the id it has):
    never one that would re-key a source another id already names, nor take an id that is
    another source's; unregistering the last registration that pinned it gives the source
    back its own id. ``version`` counts the ids given or moved."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: dict[int, str] = {}
        # (instance_id, model, routing_group) -> the registration's fields
        self.registered: dict[tuple[int, str, str], dict[str, Any]] = {}
        self.version = 0

    def id_of(self, name: str) -> int:
        wid = self.ids.get(name)
        if wid is None:
            m = _SUFFIX.search(name)
            wid = int(m.group(1)) if m and len(m.group(1)) < 19 else None
            if wid is None or wid in self.names:
                wid = hashed_worker_id(name)
                while wid in self.names:  # another name's hash, or a pin: the next one
                    wid = (wid + 1) % (1 << 63)
            self._claim(name, wid)
        return wid

    def see(self, names: Sequence[str]) -> None:
        for name in sorted(set(names) - self.ids.keys()):
            self.id_of(name)

    def _claim(self, name: str, wid: int) -> None:
        self.version += 1
        self.ids[name], self.names[wid] = wid, name

    def pin(self, name: str, wid: int) -> str | None:
        """Pin ``wid`` to source ``name``; the reason it may not (None: pinned)."""
        held, taken = self.ids.get(name), self.names.get(wid)
        if held == wid:
            return None
        if held is not None:
            return (
                f"source {name!r} is worker {held} already: a registration cannot re-key a "
                "worker it did not create"
            )
        if taken is not None:
            return f"worker id {wid} is source {taken!r}'s"
        self._claim(name, wid)
        return None

    def unpin(self, name: str) -> None:
        """No registration pins ``name`` any more: its id is its own again when next seen."""
        wid = self.ids.pop(name, None)
        if wid is not None:
            self.names.pop(wid, None)
            self.version += 1

    def worker_of(self, source: str) -> tuple[int, int]:
        """(worker id, data-parallel rank) of a source: the relay names rank r of an engine
        with ``--dp-size`` ``<source>-dp<r>``; every other source is rank 0 of its own."""
        m = _RANK.match(source)
        if m is None:
            return self.id_of(source), 0
        return self.id_of(m.group(1)), int(m.group(2))

    def see_sources(self, sources: Sequence[str]) -> None:
        self.see([_RANK.sub(r"\1", s) for s in sources])
