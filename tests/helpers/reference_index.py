"""An independent, deliberately simple model of the index, computed from the events alone.

It walks each partition's messages in order (partition by partition, unlike the consumer,
which interleaves them), and must end in the same state as the consumer's index.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg

from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    Goodbye,
    GroupSpec,
    Heartbeat,
)

FULL = {
    "full_attention",
    "mla_attention",
    "sink_full_attention",
    "encoder_only_attention",
    "cross_attention",
}


@dataclass
class Reference:
    specs: dict[tuple[str, int], tuple[str, int, int]] = field(default_factory=dict)
    blocks: dict[tuple[str, int, bytes], tuple[object, ...]] = field(default_factory=dict)
    refs: Counter[tuple[object, ...]] = field(default_factory=Counter)
    history: list[tuple[object, ...]] = field(default_factory=list)
    open_at: dict[tuple[object, ...], datetime] = field(default_factory=dict)
    status: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    # (source, model, group) -> (epoch, media that survive its restart)
    streams: dict[tuple[object, ...], tuple[int, frozenset[str]]] = field(default_factory=dict)
    # the streams that announce reused blocks as stores (GroupSpec.reports_reuse)
    reporting: set[tuple[object, ...]] = field(default_factory=set)

    def end(self, keep: object, when: datetime) -> None:
        """End every held residency for which ``keep(key)`` is false."""
        for res in list(self.refs):
            if self.refs[res] > 0 and not keep(res):  # type: ignore[operator]
                self.refs[res] = 0
                self.history.append((*res, self.open_at.pop(res), when))

    def residencies(self) -> dict[tuple[object, ...], int]:
        return {k: v for k, v in self.refs.items() if v > 0}

    def history_multiset(self) -> Counter[tuple[object, ...]]:
        rows = list(self.history) + [(*k, t, None) for k, t in self.open_at.items()]
        return Counter(rows)


def _residency(
    env: Envelope, group: int, h: bytes, ev: BlockStored | BlockRemoved
) -> tuple[object, ...]:
    """(model, group, hash, instance, medium, ownership); absent medium means GPU."""
    return (env.model, group, h, env.source, ev.medium or "GPU", ev.ownership or "")


def build(messages_by_partition: dict[int, list[bytes]]) -> Reference:
    ref = Reference()
    codec = Codec()
    for partition in sorted(messages_by_partition):
        for raw in messages_by_partition[partition]:
            try:
                env = codec.decode(raw)
            except DecodeError as exc:
                ref.status["rejected"] += 1
                ref.rejected[exc.reason] += 1
                continue
            ev = env.event
            when = datetime.fromtimestamp(env.event_time_ms / 1000, tz=UTC)
            group = getattr(ev, "group_idx", None) or 0
            reason = None
            stream = (env.source, env.model, group)
            epoch, keep = ref.streams.get(stream, (env.epoch, frozenset({"STORAGE"})))
            if isinstance(ev, GroupSpec):  # the source's word on what outlives a restart
                keep = frozenset(
                    ev.surviving_media if ev.surviving_media is not None else ("STORAGE",)
                )
                (ref.reporting.add if ev.reports_reuse else ref.reporting.discard)(stream)
            if env.epoch > epoch:  # a restart: this stream's blocks that did not survive end
                ref.end(lambda r, s=stream, k=keep: (r[3], r[0], r[1]) != s or r[4] in k, when)
            ref.streams[stream] = (max(epoch, env.epoch), keep)
            if isinstance(ev, Heartbeat):
                pass
            elif isinstance(ev, Goodbye):
                kept = {s[2]: k for s, (_, k) in ref.streams.items() if s[:2] == stream[:2]}
                ref.end(lambda r, s=stream, k=kept: (r[3], r[0]) != s[:2] or r[4] in k[r[1]], when)
            elif isinstance(ev, GroupSpec):
                ref.specs.setdefault(
                    (ev.model, ev.group_idx), (ev.kind, ev.block_size, ev.hash_block_size)
                )
            elif isinstance(ev, BlockStored):
                spec = ref.specs.get((env.model, group))
                if spec is None:
                    reason = "unknown_group"
                elif ev.block_size == 0 and not ev.token_ids:
                    reason = "placeholder_for_full_attention" if spec[0] in FULL else None
                elif not ev.token_ids and spec[0] != "mamba":  # a state checkpoint elsewhere
                    reason = "token_count_mismatch"
                elif not ev.token_ids and len(ev.block_hashes) != 1:
                    reason = "invalid_event"
                elif ev.block_size != (spec[2] if ev.partial else spec[1]):
                    reason = "block_size_mismatch"
                elif ev.token_ids and len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
                    reason = "token_count_mismatch"
                if reason is None:
                    parent = ev.parent_block_hash
                    for i, h in enumerate(ev.block_hashes):
                        size = ev.block_size
                        start = ev.token_start + i * size if ev.token_start is not None else None
                        row = (
                            parent,
                            start,
                            tuple(ev.token_ids[i * size : (i + 1) * size]),
                            size,
                            ev.partial,
                        )
                        key = (env.model, group, h)
                        old = ref.blocks.get(key)
                        if old is None or (
                            size > 0 and (old[3] == 0 or (old[4] and not ev.partial))
                        ):
                            ref.blocks[key] = row
                        parent = h
                        res = _residency(env, group, h, ev)
                        if stream in ref.reporting and ref.refs[res] > 0:
                            continue  # a reused block reported again: still one copy
                        ref.refs[res] += 1
                        if ref.refs[res] == 1:
                            ref.open_at[res] = when
            elif isinstance(ev, BlockRemoved):
                if (env.model, group) not in ref.specs:
                    reason = "unknown_group"
                else:
                    for h in ev.block_hashes:
                        res = _residency(env, group, h, ev)
                        if ref.refs[res] > 0:
                            ref.refs[res] -= 1
                            if ref.refs[res] == 0:
                                ref.history.append((*res, ref.open_at.pop(res), when))
            elif isinstance(ev, AllBlocksCleared):
                for res in list(ref.refs):
                    if (
                        res[0] == env.model
                        and res[1] == group
                        and res[3] == env.source
                        and res[4] == (ev.medium or "GPU")
                        and ref.refs[res] > 0
                    ):
                        ref.refs[res] = 0
                        ref.history.append((*res, ref.open_at.pop(res), when))
            if reason is None:
                ref.status["applied"] += 1
            else:
                ref.status["rejected"] += 1
                ref.rejected[reason] += 1
    return ref


def index_state(conn: psycopg.Connection) -> dict[str, object]:
    """The consumer's index, in the reference's shapes."""
    blocks = {
        (m, g, bytes(h)): (bytes(p) if p is not None else None, s, tuple(t), bs, partial)
        for m, g, h, p, s, t, bs, partial in conn.execute(
            "SELECT model, group_idx, block_hash, parent_hash, token_start, token_ids, "
            "block_size, partial FROM kvledger.blocks"
        ).fetchall()
    }
    residencies = {
        (m, g, bytes(h), i, md, o): c
        for m, g, h, i, md, o, c in conn.execute(
            "SELECT model, group_idx, block_hash, instance, medium, ownership, refcount "
            "FROM kvledger.residencies"
        ).fetchall()
    }
    history = Counter(
        (m, g, bytes(h), i, md, o, s, r)
        for m, g, h, i, md, o, s, r in conn.execute(
            "SELECT model, group_idx, block_hash, instance, medium, ownership, stored_at, "
            "removed_at FROM kvledger.residency_history"
        ).fetchall()
    )
    status = Counter(
        dict(
            conn.execute("SELECT status, count(*) FROM kvledger.events GROUP BY status").fetchall()
        )
    )
    rejected = Counter(
        dict(
            conn.execute(
                "SELECT reason, count(*) FROM kvledger.rejected_events GROUP BY reason"
            ).fetchall()
        )
    )
    return {
        "blocks": blocks,
        "residencies": residencies,
        "history": history,
        "status": status,
        "rejected": rejected,
    }
