"""The index rules: decoded messages + the state they touch → a plan (pure, no I/O).

:func:`~.needs.needs` says what a batch touches (for the store to load); :func:`make_plan`
walks the batch in order over a :class:`~.model.Snapshot` and returns a :class:`~.model.Plan`.
Per message: the sequence rule (:mod:`.sequence`), validation (:mod:`.validate`), then:

- GroupSpec: a new group's shape is recorded (declared specs win; a different shape is a
  ``spec_conflict``);
- BlockStored: one block row per hash (content kept from the first writer, upgraded only
  over a placeholder, a partial-tail row or a row of unknown position; a different content
  is a ``hash_conflict``, which rejects the whole event), and one holder reference per hash.
  An event without ``token_start`` (vLLM sends none) starts at 0 when it has no parent, else
  where its parent's row ends, when that is known. Lora name and extra keys are kept from
  the first writer that has them. The block rows and their content rules are the compiled
  core's (``kvledger._core.BlockRows``, rust/src/plan_rows.rs): the planner hands it each
  event whole, and stores take its rows compact. From a source that announces reused
  blocks as stores (``GroupSpec.reports_reuse``: vLLM's ``kv_cache_report_mode="full"``),
  a store of a block it holds there adds no reference (``reported_reuse`` in the audit
  log): a rare second physical copy then counts once, so its first removal ends the holder
  (a missed hit);
- BlockRemoved: one reference less per hash; a removal with no reference left is a
  recorded no-op, never a negative count;
- AllBlocksCleared: every reference of the instance on that medium (every ownership) in
  that group, or in every group of the model when the event names none, ends "cleared";
- EventsLost: a relay lost engine batches it could not recover; every reference of the
  instance in that group, every medium and ownership, ends "lost" (a missed hit costs a
  router little, a route to blocks that are gone costs a lot), and the range is recorded;
- Heartbeat: nothing but liveness; Goodbye and a new epoch: see :mod:`.lifecycle`.

Replaying a rejected BlockStored (``dlq replay``): when its holder has since recorded a
removal that found no reference (``noop_removal``) the removal may have been this store's,
and adding its references now would leave holders that never end. Such a store writes its
block rows but no holder references ("replayed_without_holders" in the audit log): a missed
hit costs a router little, a phantom holder a lot. Other replayed stores apply in full.

Reference counts and history intervals: :mod:`.refs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from kvledger.consumer.core.audit import audit_row
from kvledger.consumer.core.compact import BlockRows, micros
from kvledger.consumer.core.lifecycle import Lives, restart_policy, surviving, utc
from kvledger.consumer.core.model import (
    PRIMARY_OWNERSHIP,
    GroupKey,
    HeldSpec,
    HolderKey,
    HolderScope,
    LifecycleEvent,
    Plan,
    Rejection,
    Snapshot,
    SourceKey,
    SourceState,
    new_tuple,
)
from kvledger.consumer.core.refs import References
from kvledger.consumer.core.sequence import Verdict, advance
from kvledger.consumer.core.validate import (
    Invalid,
    Reason,
    check_announcement,
    check_cleared,
    check_envelope,
    check_lost,
    check_removed,
    check_stored,
)
from kvledger.consumer.inbound import Decoded, Inbound
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventsLost,
    Goodbye,
    GroupSpec,
    Heartbeat,
    group_of,
    medium_of,
)


def event_time(env: Envelope) -> datetime:
    return utc(env.event_time_ms)


def make_plan(batch: Sequence[Decoded], snapshot: Snapshot, replay: bool = False) -> Plan:
    """Apply the index rules to ``batch`` (in order) over ``snapshot``.

    ``replay``: re-applying rejected messages, without sequence checks.
    """
    planner = _Planner(snapshot, replay)
    for d in batch:
        planner.message(d)
    return planner.finish()


@dataclass(frozen=True, slots=True)
class _Ended:
    """What a restart, a goodbye or a lost range ended: its kind, its group (None: every
    group), residencies ended per medium, the epoch before a restart, a lost range."""

    kind: str  # restart | closed | lost
    group: int | None
    ended: dict[str, int]
    previous: int | None = None
    lost: tuple[int, int] | None = None


class _Planner:
    """The walk over one batch: the snapshot, overlaid with the batch's changes."""

    def __init__(self, snapshot: Snapshot, replay: bool) -> None:
        self.snap = snapshot
        self.plan = Plan(replay=replay)
        self.specs: dict[GroupKey, HeldSpec] = dict(snapshot.specs)
        self.rows = BlockRows(snapshot.blocks, snapshot.block_base)  # the rows this batch writes
        self.refs = References(snapshot)
        self.sources: dict[SourceKey, SourceState] = {}
        self.lives = Lives(snapshot.lives)
        self.late = set(snapshot.late_removals) if replay else set()

    def finish(self) -> Plan:
        plan = self.plan
        plan.rows = self.rows.sealed()
        plan.refs = self.refs.native.sealed()
        plan.sources = self.sources
        plan.lives = self.lives.result()
        plan.model_changes = self.lives.model_changes
        return plan

    # ------------------------------------------------------------------ per message
    def message(self, d: Decoded) -> None:  # noqa: C901 - the admission rules in the order they apply
        plan = self.plan
        plan.messages += 1
        env = d.envelope
        if env is None:
            assert d.error is not None
            self._reject(d, Reason(d.error.reason), d.error.detail, None)
            return
        invalid = check_envelope(env, d.message.key, d.message.timestamp_ms)
        if invalid is not None:  # before it touches any stream's state, and none of its
            # values reaches a row (they may be what the store cannot hold): its bytes do
            self._reject(Decoded(d.message, None, None), invalid.reason, invalid.detail, None)
            return
        when = event_time(env)  # once per message
        if not plan.replay:
            key = new_tuple(SourceKey, (env.source, env.model, group_of(env.event)))
            state = self.sources.get(key)
            if state is None and (held := self.snap.sources.get(key)) is not None:
                state = self.sources[key] = held.copy()  # the batch's own copy
            previous = (state.epoch, state.surviving_media) if state is not None else None
            verdict, nxt = advance(state, env.epoch, env.seq, when, in_place=True)
            if nxt is not None:
                self.sources[key] = nxt
            if verdict is Verdict.STALE:
                detail = f"epoch {env.epoch} is older than the source's current epoch"
                self._reject(d, Reason.STALE_EPOCH, detail, when)
                return
            if verdict is Verdict.JUMP:
                assert state is not None
                detail = f"seq {env.seq} is more than a million past the stream's {state.last_seq}"
                self._reject(d, Reason.SEQUENCE_JUMP, detail, when)
                return
            if verdict is Verdict.DUPLICATE:  # skipped, but kept with its bytes (replayable)
                plan.duplicates += 1
                detail = f"seq {env.seq} of epoch {env.epoch} was already applied"
                plan.rejected.append(
                    Rejection(d.message, Reason.DUPLICATE.value, detail, env.source)
                )
                self._audit(d, "duplicate", None, (0, 0), when)
                return
            if verdict is Verdict.GAP:
                plan.gaps += 1
            self.lives.observe(d.message, env)
            if previous is not None and env.epoch > previous[0]:
                self._restart(env, key, previous, d.message, when)
        invalid, hashes, noop = self._event(env, d.message, when)
        if invalid is not None:
            self._reject(d, invalid.reason, invalid.detail, when)
        else:
            plan.applied += 1
            kind = "reported_reuse" if isinstance(env.event, BlockStored) else "noop_removal"
            reason = kind if noop else None
            m = d.message
            if (
                self.late
                and isinstance(env.event, BlockStored)
                and ((m.topic, m.partition, m.offset) in self.late)
            ):
                reason = "replayed_without_holders"
            self._audit(d, "applied", reason, (hashes, noop), when)

    def _event(
        self, env: Envelope, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        """Validate and apply one event: (why it is invalid, hashes applied, no-op removals)."""
        ev = env.event
        if isinstance(ev, GroupSpec):
            return self._announce(env, ev), 0, 0
        if isinstance(ev, Heartbeat):
            return None, 0, 0
        if isinstance(ev, Goodbye):
            return None, self._goodbye(env, msg, when), 0
        if isinstance(ev, BlockStored):
            return self._stored(env, ev, msg, when)
        if isinstance(ev, BlockRemoved):
            return self._removed(env, ev, msg, when)
        if isinstance(ev, EventsLost):
            return self._lost(env, ev, msg, when)
        return self._cleared(env, ev, msg, when)

    def _announce(self, env: Envelope, ev: GroupSpec) -> Invalid | None:
        if ev.model != env.model:
            return Invalid(
                Reason.INVALID_EVENT, f"announcement for model {ev.model} from {env.model}"
            )
        key = GroupKey(ev.model, ev.group_idx)
        invalid = check_announcement(ev, self.specs.get(key))
        if invalid is None and key not in self.specs:
            self.specs[key] = HeldSpec(ev, "announced")
            self.plan.new_specs.append((ev, env.source))
        stream = self.sources.get(SourceKey(env.source, env.model, ev.group_idx))
        if invalid is None and stream is not None:  # the source's policies
            stream.surviving_media = ev.surviving_media
            stream.reports_reuse = ev.reports_reuse
        return invalid

    def _stored(
        self, env: Envelope, ev: BlockStored, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        model, group = env.model, group_of(ev)
        invalid = check_stored(ev, self.specs.get(new_tuple(GroupKey, (model, group))))
        if invalid is not None:
            return invalid, 0, 0
        start = ev.token_start
        if start is None and not ev.is_placeholder:  # at 0, or where its parent's row ends
            parent = ev.parent_block_hash
            start = 0 if parent is None else self.rows.token_end(model, group, parent)
        when_us = micros(when)
        why = self.rows.store(
            model,
            group,
            ev.block_hashes,
            ev.token_ids,
            ev.block_size,
            start,
            ev.parent_block_hash,
            ev.partial,
            ev.lora_name,
            ev.extra_keys,
            when_us,
        )
        if why is not None:
            return Invalid(Reason.HASH_CONFLICT, why), 0, 0
        hashes = ev.block_hashes
        self.plan.block_events += len(hashes)
        if self.late and (msg.topic, msg.partition, msg.offset) in self.late:
            return None, len(hashes), 0  # its rows, no holders (see the module's docstring)
        source = env.source
        holder = new_tuple(
            HolderKey, (model, group, source, medium_of(ev), ev.ownership or PRIMARY_OWNERSHIP)
        )
        stream = new_tuple(SourceKey, (source, model, group))
        state = self.sources.get(stream) or self.snap.sources.get(stream)
        reports = state is not None and state.reports_reuse
        reused = self.refs.store(holder, hashes, when_us, ev.locality, msg, reports)
        self.plan.reported_reuse += reused
        return None, len(hashes), reused

    def _removed(
        self, env: Envelope, ev: BlockRemoved, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        group = group_of(ev)
        invalid = check_removed(ev, self.specs.get(new_tuple(GroupKey, (env.model, group))))
        if invalid is not None:
            return invalid, 0, 0
        holder = new_tuple(
            HolderKey,
            (env.model, group, env.source, medium_of(ev), ev.ownership or PRIMARY_OWNERSHIP),
        )
        noop = self.refs.remove(holder, ev.block_hashes, when, ev.locality, msg)
        self.plan.noop_removals += noop
        self.plan.block_events += len(ev.block_hashes)
        return None, len(ev.block_hashes), noop

    def _cleared(
        self, env: Envelope, ev: AllBlocksCleared, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        invalid = check_cleared(ev)
        if invalid is not None:
            return invalid, 0, 0
        medium = medium_of(ev)
        groups = (
            [ev.group_idx]
            if ev.group_idx is not None
            else sorted({k.group_idx for k in self.specs if k.model == env.model})
        )
        cleared = 0
        for group in groups:
            scope = HolderScope(env.model, group, env.source, medium, None)
            cleared += sum(self.refs.end(self.refs.live(scope), "cleared", when, msg).values())
        return None, cleared, 0

    def _lost(
        self, env: Envelope, ev: EventsLost, msg: Inbound, when: datetime
    ) -> tuple[Invalid | None, int, int]:
        invalid = check_lost(ev)
        if invalid is not None:
            return invalid, 0, 0
        group = group_of(ev)
        scope = HolderScope(env.model, group, env.source, None, None)
        ended = self.refs.end(self.refs.live(scope), "lost", when, msg)
        state = self.sources.get(SourceKey(env.source, env.model, group))
        if state is not None:  # None when replaying a rejected message
            state.lost_gaps += 1
            state.lost_batches += ev.last_seq - ev.first_seq + 1
        self._lifecycle(
            env, msg, when, _Ended("lost", group, ended, lost=(ev.first_seq, ev.last_seq))
        )
        return None, sum(ended.values()), 0

    # ------------------------------------------------------------------ lifecycle
    def _policy(self, stream: SourceKey) -> frozenset[str]:
        state = self.sources.get(stream) or self.snap.sources.get(stream)
        return surviving(state.surviving_media if state is not None else None)

    def _restart(
        self,
        env: Envelope,
        stream: SourceKey,
        previous: tuple[int, tuple[str, ...] | None],
        msg: Inbound,
        when: datetime,
    ) -> None:
        """A newer epoch of a stream: its residencies on non-surviving media end.

        ``previous``: the stream's epoch and announced survivors before this message."""
        keep = surviving(restart_policy(env, previous[1]))
        scope = HolderScope(env.model, stream.group_idx, env.source, None, None)
        keys = [k for k in self.refs.live(scope) if k.medium not in keep]
        ended = self.refs.end(keys, "restart", when, msg)
        self._lifecycle(env, msg, when, _Ended("restart", stream.group_idx, ended, previous[0]))

    def _goodbye(self, env: Envelope, msg: Inbound, when: datetime) -> int:
        """A clean shutdown: the source's residencies on non-surviving media end, every group."""
        keys = [
            k
            for k in self.refs.live(HolderScope(env.model, None, env.source, None, None))
            if k.medium not in self._policy(SourceKey(env.source, env.model, k.group_idx))
        ]
        ended = self.refs.end(keys, "closed", when, msg)
        self._lifecycle(env, msg, when, _Ended("closed", None, ended))
        return len(keys)

    def _lifecycle(self, env: Envelope, msg: Inbound, when: datetime, what: _Ended) -> None:
        ended = what.ended
        counts = (ended.get("GPU", 0), ended.get("CPU", 0), ended.get("STORAGE", 0))
        where = (msg.topic, msg.partition, msg.offset)
        event = LifecycleEvent(
            env.source,
            env.model,
            what.group,
            what.kind,
            env.epoch,
            what.previous,
            when,
            *where,
            *counts,
            *(what.lost or (None, None)),
        )
        self.plan.lifecycle.append(event)

    # ------------------------------------------------------------------ audit
    def _audit(
        self,
        d: Decoded,
        status: str,
        reason: str | None,
        counts: tuple[int, int],
        when: datetime | None,
    ) -> None:
        """One audit row, unless the store keeps none; ``counts``: the hashes the message
        named, its no-op hashes."""
        if self.snap.history:
            self.plan.audit.append(audit_row(d, status, reason, counts, when))

    def _reject(self, d: Decoded, reason: Reason, detail: str, when: datetime | None) -> None:
        env = d.envelope
        source = env.source if env is not None else None
        self.plan.rejected.append(Rejection(d.message, reason.value, detail, source))
        hashes = len(getattr(env.event, "block_hashes", ())) if env is not None else 0
        self._audit(d, "rejected", reason.value, (hashes, 0), when)
