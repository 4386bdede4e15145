"""NVIDIA Dynamo's KV-indexer API over the router index (`kvledger serve --dynamo-api`,
from the --memory router or, beside SQL, one of its own): Dynamo's indexer, selection
service and routers ask kvledger as they ask
Dynamo's own standalone indexer (crate ``dynamo-kv-router`` 1.6.1, ``python -m
dynamo.indexer``), at its paths, with its JSON and status codes.

POST /query          {"token_ids", "model_name", "routing_group"?, "lora_name"?}
POST /query_by_hash  {"block_hashes": [Dynamo local hashes], "model_name", ...}
                     → {"scores": {worker: {dp_rank: tokens}}, "frequencies": [],
                        "instances": {worker: {"longest_matched", "gpu", "dp", "cpu", "disk"}}}
GET  /dump           every live worker's blocks as Dynamo's events, per "model:routing_group"
GET  /workers        the workers (kvledger's sources) in Dynamo's shape
POST /register       {"instance_id", "model_name", "endpoint", "block_size", "source"?}
POST /unregister     {"instance_id", "model_name", ...}
GET  /health         200

Its HTTP face: the route table's entries (:data:`.table.DYNAMO`). The mapping
(docs/routers.md, "kvledger as Dynamo's KV indexer"):
- a (model, routing group) is kvledger's (model, group): routing group ``default`` is
  group 0, a routing group ``N`` (digits) is group N;
- a worker is a kvledger source at data-parallel rank 0; its id is the integer a source's
  name ends in (``engine-3`` is 3), else — when the name has none, or an earlier source
  claimed that integer — a stable 63-bit hash of the name; ``/register`` with ``source``
  pins an id to a source;
- tiers: GPU is Dynamo's device tier, CPU its host tier, STORAGE its disk tier; each lower
  tier continues the match from where the tier above it ended, as Dynamo's do;
- kvledger's rules stay: a source that is silent (``--silent-after``) or closed is not
  scored nor dumped, restarts and lost gaps end what they end.

Where decisions are recorded (``serve --memory --decisions-topic``), every /query answer is
recorded as an answer no choice was reported for (what each worker was offered), its record
made on the decision log's thread.

Blocks are keyed by Dynamo's local hash, computed by the core from each block's tokens at
apply time (rust/src/group/dynamo.rs); blocks with extra keys (a cache salt, multimodal
inputs) have none: kvledger does not know how Dynamo would hash them, so it claims none.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from kvledger.consumer.core.model import GroupKey
from kvledger.schemas.decisions import TOKENS, Answered, Record
from kvledger.serving.lookup.dynamo_names import US, block_id, group_of, routing_group_of, seen_us
from kvledger.serving.lookup.dynamo_requests import (
    DEFAULT_ROUTING_GROUP,
    DynamoRequestError,
    Query,
    field,
    int_field,
    json_object,
    parse_query,
)
from kvledger.serving.lookup.dynamo_workers import Workers
from kvledger.serving.lookup.offer import answer_record
from kvledger.serving.router.groups import SlotTable
from kvledger.serving.router.match import DEFAULT_SILENT_AFTER, is_live, state_of
from kvledger.serving.router.provisional import Provisional, chain_keys

if TYPE_CHECKING:
    from kvledger.serving.router.index import RouterIndex
    from kvledger.serving.router.store import RouterStore

TIERS = {"GPU": 0, "CPU": 1, "STORAGE": 2}  # device, host_pinned, disk
TIER_NAMES = ("device", "host_pinned", "disk")
# What /register keeps: registrations at most, and the length of their names.
MAX_REGISTRATIONS = 1024
MAX_NAME_CHARS = 256
MAX_ENDPOINT_CHARS = 2048

Answer = tuple[int, Any]  # (status, a body to send as JSON, or its JSON bytes)
EMPTY_ANSWER = b'{"scores":{},"frequencies":[],"instances":{}}'


# ---------------------------------------------------------------------- the API
class DynamoApi:
    """Dynamo's indexer routes over a :class:`RouterIndex` built with ``dynamo=True``."""

    def __init__(
        self,
        router: RouterIndex,
        silent_after: timedelta | None = None,
        provisional: Provisional | None = None,
        record: Callable[[Answered, Callable[[], Record]], None] | None = None,
    ) -> None:
        if not router.dynamo:
            raise ValueError("Dynamo's API needs a RouterIndex(dynamo=True)")
        self.router = router
        self.provisional = provisional  # routers' decisions, answered in /query's scores
        self.record = record  # each answer's record (a DecisionLog's note_answer)
        self.window = silent_after if silent_after is not None else DEFAULT_SILENT_AFTER
        self.workers = Workers()
        self._window_us = self.window // US
        # The slot table answers are written from (see _slots), and the store it follows
        # (a bootstrap replaces the router's store: the table is then made again).
        self._table_store: RouterStore = router.store
        self._table: SlotTable = router.store.dynamo_slots()
        self._slot_of: dict[str, int] = {}  # instance -> its slot
        self._slot_names: list[str] = []  # slot -> its instance
        self._worker_names: dict[int, str] = {}  # worker id -> its lowest rank's instance
        self._table_workers = -1  # the Workers.version its worker ids are from

    def _live(self, store: RouterStore, now: datetime) -> dict[str, bool]:
        cut = now - self.window
        return {name: is_live(life, cut) for name, life in store.lives.items()}

    def _slots(self, store: RouterStore) -> SlotTable:
        """The slot table of ``store`` brought up to date (call under the router's lock): a
        slot per instance; each holder's ``slot * 3 + tier`` (-1: a tier Dynamo has not),
        appended as the store's holders are; each slot's worker id and rank, given to every
        instance at once when one is new or an id moved; each slot's last sight, set again
        for the sources whose lives changed since the last query."""
        if self._table_store is not store:
            self._table_store, self._table = store, store.dynamo_slots()
            self._slot_of, self._slot_names = {}, []
        table, names, lives = self._table, self._slot_names, store.lives
        added = False
        for instance, medium, _ in store.holders[table.sizes()[0] :]:
            slot = self._slot_of.get(instance)
            if slot is None:
                slot = self._slot_of[instance] = len(names)
                names.append(instance)
                table.set_slot(slot, 0, 0, None)  # its worker: below
                added = True
            tier = TIERS.get(medium)
            table.add_holder(-1 if tier is None else slot * 3 + tier)
        if added or self._table_workers != self.workers.version:
            lives.drain()
            self.workers.see_sources(names)
            ranked: dict[int, tuple[int, str]] = {}
            for slot, name in enumerate(names):
                wid, rank = self.workers.worker_of(name)
                table.set_slot(slot, wid, rank, seen_us(lives.get(name)))
                ranked[wid] = min(ranked.get(wid, (rank, name)), (rank, name))
            self._worker_names = {wid: name for wid, (_, name) in ranked.items()}
            self._table_workers = self.workers.version
        else:
            for name in lives.drain():
                slot = self._slot_of.get(name)
                if slot is not None:
                    table.set_seen(slot, seen_us(lives.get(name)))
        return table

    def _partition(self, store: RouterStore, model: str, routing_group: str) -> GroupKey:
        group = group_of(routing_group)
        key = GroupKey(model, group) if group is not None else None
        if key is None or key not in store.specs:
            raise DynamoRequestError(
                404, f"no indexer for model={model} routing_group={routing_group}"
            )
        return key

    def query(self, raw: bytes, by_hash: bool) -> Answer:
        """A /query or /query_by_hash answer, its body JSON already (written by the core
        in the walk's call: rust/src/dynamo_answer.rs)."""
        q = parse_query(raw, by_hash)
        cut = time.time_ns() // 1000 - self._window_us
        with self.router.lock:
            store = self.router.store
            key = self._partition(store, q.model, q.routing_group)
            g = store.groups.get(key)
            block_size = store.specs[key].spec.block_size
            body = EMPTY_ANSWER if g is None else q.answer(g, block_size, self._slots(store), cut)
            names = self._worker_names  # replaced, never changed, when worker ids move
            p = self.provisional
            plain = by_hash or g is None or p is None or p.empty(key.model, key.group_idx, TOKENS)
            if not plain:
                workers = {
                    name: (*self.workers.worker_of(name), seen_us(store.lives.get(name)))
                    for name in self._slot_names
                }
        if self.record is not None:  # what the index offered, without provisional marks
            self.record(
                Answered(key.model, key.group_idx),
                partial(answer_record, body, names, block_size, q.blocks(block_size)),
            )
        if plain:
            return 200, body
        return 200, self._with_provisional(q, key, block_size, body, workers, cut)

    def _with_provisional(  # noqa: PLR0913 - one Dynamo answer's pieces, as its parse left them
        self,
        q: Query,
        key: GroupKey,
        block_size: int,
        body: bytes,
        workers: dict[str, tuple[int, int, int | None]],
        cut: int,
    ) -> bytes:
        """``body`` with the live instances routers sent this prompt to scored as if they
        held what was sent (GPU tier), named under ``"provisional"`` (worker id -> tokens),
        where that is more than they hold."""
        assert self.provisional is not None
        locals_ = q.hashes(block_size)
        answer = json.loads(body)
        scores, instances = answer["scores"], answer["instances"]
        real = {
            name: scores.get(str(wid), {}).get(str(rank), 0) // block_size
            for name, (wid, rank, _) in workers.items()
        }
        depths = self.provisional.depths(
            key.model, key.group_idx, TOKENS, chain_keys(locals_), real
        )
        marked: dict[str, int] = {}
        for name, blocks in depths.items():
            if name not in workers:
                continue
            wid, rank, seen = workers[name]
            if seen is None or seen < cut:
                continue  # not live: left out, as its real blocks are
            tokens, w, r = blocks * block_size, str(wid), str(rank)
            scores.setdefault(w, {})[r] = tokens
            entry = instances.setdefault(
                w, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
            )
            entry["dp"][r] = max(entry["dp"].get(r, 0), tokens)
            for tier in ("gpu", "cpu", "disk", "longest_matched"):
                entry[tier] = max(entry[tier], tokens)
            marked[w] = tokens
        if not marked:
            return body
        answer["provisional"] = marked
        return json.dumps(answer, separators=(",", ":")).encode()

    # ------------------------------------------------------------------ /dump
    def dump(self) -> Answer:
        now = datetime.now(UTC)
        out: dict[str, Any] = {}
        with self.router.lock:
            store = self.router.store
            live = self._live(store, now)
            self.workers.see_sources([n for n, ok in live.items() if ok])
            for key, held in store.specs.items():
                g = store.groups.get(key)
                events = list(self._events(store, g, live)) if g is not None else []
                label = f"{key.model}:{routing_group_of(key.group_idx)}"
                out[label] = {"block_size": held.spec.block_size, "events": events}
        return 200, out

    def _events(
        self, store: RouterStore, g: Any, live: dict[str, bool]
    ) -> Iterator[dict[str, Any]]:
        """One stored event per chain a live holder holds on a Dynamo tier, parents first."""
        event_id = 0
        for hid, (instance, medium, _) in enumerate(store.holders):
            tier = TIERS.get(medium)
            if tier is None or not live.get(instance, False):
                continue
            wid, rank = self.workers.worker_of(instance)
            rows = {}
            for h in g.held_by(hid):
                local = g.dynamo_local(h)
                row = g.row(h)
                if local is not None and row is not None:
                    rows[h] = (row[0], row[1], local)
            # parents first: by token position (a block without one after those with)
            order = sorted(rows, key=lambda h: (rows[h][1] is None, rows[h][1] or 0, h))
            sent: set[bytes] = set()
            for h in order:
                parent, _, local = rows[h]
                if tier == 0 and parent is not None and parent not in sent:
                    continue  # Dynamo's device tree reaches no block past a gap
                sent.add(h)
                event_id += 1
                yield {
                    "worker_id": wid,
                    "storage_tier": TIER_NAMES[tier],
                    "event": {
                        "event_id": event_id,
                        "dp_rank": rank,
                        "data": {
                            "stored": {
                                "parent_hash": block_id(parent) if parent is not None else None,
                                "start_position": None,
                                "blocks": [
                                    {
                                        "block_hash": block_id(h),
                                        "tokens_hash": local,
                                        "mm_extra_info": None,
                                    }
                                ],
                            }
                        },
                    },
                }

    # ------------------------------------------------------------------ workers
    def list_workers(self, model: str | None, routing_group: str | None) -> Answer:
        now = datetime.now(UTC)
        with self.router.lock:
            store = self.router.store
            sizes = {k: h.spec.block_size for k, h in store.specs.items()}
            # (worker id, partition) -> its ranks' listener states
            seen: dict[tuple[int, GroupKey], dict[int, str]] = {}
            self.workers.see_sources(list(store.lives))
            for name, life in store.lives.items():
                state = state_of(life, now, self.window)
                if state not in ("live", "silent"):
                    continue
                wid, rank = self.workers.worker_of(name)
                for key in sizes:
                    if key.model == life.model:
                        status = "active" if state == "live" else "paused"
                        seen.setdefault((wid, key), {})[rank] = status
            out = []
            for (wid, key), ranks in sorted(seen.items()):
                rg = routing_group_of(key.group_idx)
                reg = self.workers.registered.get((wid, key.model, rg))
                out.append(self._worker(wid, key.model, rg, sizes[key], ranks, reg))
            for (wid, m, rg), reg in sorted(self.workers.registered.items()):
                group = group_of(rg)
                if group is None or (wid, GroupKey(m, group)) not in seen:
                    out.append(self._worker(wid, m, rg, reg["block_size"], {0: "pending"}, reg))
        return 200, [
            w
            for w in out
            if (model is None or w["model_name"] == model)
            and (routing_group is None or w["routing_group"] == routing_group)
        ]

    def _worker(  # noqa: PLR0913 - one Dynamo answer's pieces, as its parse left them
        self,
        wid: int,
        model: str,
        routing_group: str,
        block_size: int,
        ranks: dict[int, str],
        reg: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """One worker in Dynamo's shape (its listener status the aggregate of its ranks',
        as Dynamo's is), and the kvledger source it is."""
        endpoint = reg["endpoint"] if reg else ""
        states = set(ranks.values())
        status = next(s for s in ("pending", "active", "paused") if s in states)
        return {
            "instance_id": wid,
            "source": "zmq",
            "status": status,
            "model_name": model,
            "routing_group": routing_group,
            "block_size": block_size,
            "endpoints": {str(r): endpoint for r in sorted(ranks)},
            "listeners": {
                str(r): {"endpoint": endpoint, "status": st} for r, st in sorted(ranks.items())
            },
            "kvledger_source": self.workers.names.get(wid),
        }

    def register(self, raw: bytes) -> Answer:
        body = json_object(raw)
        missing = [
            f for f in ("instance_id", "model_name", "endpoint", "block_size") if f not in body
        ]
        if missing:  # all of them at once, not one 422 at a time
            fields = ", ".join(f"`{f}`" for f in missing)
            raise DynamoRequestError(
                422, f"Failed to deserialize the JSON body: missing field(s) {fields}"
            )
        wid = int_field([field(body, "instance_id", int)], "instance_id", 0, 1 << 64, 1)[0]
        model = _bounded(field(body, "model_name", str), "model_name")
        endpoint = _bounded(field(body, "endpoint", str), "endpoint", MAX_ENDPOINT_CHARS)
        rg = _bounded(field(body, "routing_group", str, DEFAULT_ROUTING_GROUP), "routing_group")
        block_size = int_field([field(body, "block_size", int)], "block_size", 1, 1 << 32, 1)[0]
        source = field(body, "source", str, None)
        if source is not None:
            _bounded(source, "source")
        key = (wid, model, rg)
        with self.router.lock:
            group = group_of(rg)
            held = (
                self.router.store.specs.get(GroupKey(model, group)) if group is not None else None
            )
            if held is not None and held.spec.block_size != block_size:
                why = (
                    f"block_size {block_size} does not match the index's "
                    f"{held.spec.block_size} for model={model} routing_group={rg}"
                )
                return 409, {"error": why}
            registered = self.workers.registered
            if key not in registered and len(registered) >= MAX_REGISTRATIONS:
                return 409, {
                    "error": f"{MAX_REGISTRATIONS} workers are registered, the most "
                    "this service keeps: unregister one first"
                }
            before = registered.get(key, {}).get("source")
            if source is not None and (refused := self.workers.pin(source, wid)) is not None:
                return 409, {"error": refused}
            registered[key] = {"endpoint": endpoint, "block_size": block_size, "source": source}
            if before is not None and before != source:
                self._release(before)
        return 201, {"status": "ok"}

    def unregister(self, raw: bytes) -> Answer:
        body = json_object(raw)
        wid = int_field([field(body, "instance_id", int)], "instance_id", 0, 1 << 64, 1)[0]
        model = field(body, "model_name", str)
        rg = field(body, "routing_group", str, None)
        with self.router.lock:
            gone = [
                k
                for k in self.workers.registered
                if k[0] == wid and k[1] == model and (rg is None or k[2] == rg)
            ]
            for k in gone:
                source = self.workers.registered.pop(k)["source"]
                if source is not None:
                    self._release(source)
        if not gone:
            return 404, {
                "error": f"worker {wid} is not registered for model={model[:256]} "
                "(kvledger follows its sources from the log: one leaves when its "
                "engine says goodbye or goes silent)"
            }
        return 200, {"status": "ok"}

    def _release(self, source: str) -> None:
        """A registration pinning ``source`` is gone: unpinned unless another still pins it."""
        if all(reg["source"] != source for reg in self.workers.registered.values()):
            self.workers.unpin(source)


def _bounded(value: str, name: str, limit: int = MAX_NAME_CHARS) -> str:
    if len(value) > limit or "\x00" in value:
        raise DynamoRequestError(
            422,
            f"Failed to deserialize the JSON body: `{name}` is over {limit} characters "
            "or holds a NUL",
        )
    return value
