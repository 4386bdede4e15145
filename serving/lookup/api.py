"""Lookups over the index: which holders have the longest prefix of a prompt, on which tier.

A thin, typed layer over the SQL functions the migrations create (kvledger.match_prefix,
match_prefix_at and match_tokens), so that any language can ask the same questions in SQL.

Answers "now" leave out holders whose source is not live (silent longer than the window,
closed by a goodbye, or unknown) unless ``include_silent`` is set; every holder carries its
source's state, so a caller that includes them sees why they would have been left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Literal, Protocol, get_args

import psycopg

from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.lookup import Block, EngineLoad, Holder, Ranked, Residency

DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
)


class NotRetainedError(KvledgerError, ValueError):
    """An as-of question about a time whose history retention has dropped."""


Granularity = Literal["block", "hash"]
GRANULARITIES: tuple[Granularity, ...] = get_args(Granularity)


def _check(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, not {granularity!r}")


def split_live(holders: Sequence[Holder]) -> tuple[list[Holder], list[Holder]]:
    """(holders whose source is live, the others)."""
    live = [h for h in holders if h.source_state == "live"]
    return live, [h for h in holders if h.source_state != "live"]


def deepest_states(found: Iterable[tuple[str, int]], upto: Mapping[str, int]) -> dict[str, int]:
    """Per instance, the deepest position among ``found`` (instance, 1-based position of a
    held state checkpoint) that is within its prefix ``upto[instance]``."""
    out: dict[str, int] = {}
    for instance, pos in found:
        if pos <= upto.get(instance, 0) and pos > out.get(instance, 0):
            out[instance] = pos
    return out


def unknown_group(model: str, group_idx: int) -> str:
    """What an answer says of a (model, group) the index has no spec for: a mistyped model
    or group, or one whose engines have not announced it yet."""
    return (
        f"no group spec for model {model!r} group {group_idx}: the index knows nothing of it "
        "(`kvledger groups list` shows the groups it knows)"
    )


class PrefixLookups(Protocol):
    """What the service asks of an index, whichever holds it: :class:`PrefixIndex` (SQL)
    and the router's memory (the service's adapter over a RouterIndex). Answers are the
    same for the same index (tests/test_conformance.py holds every implementation to one
    brute-force oracle); a question an implementation cannot answer (memory keeps no
    history and no block rows) raises the service's BadRequestError, a 400."""

    def match(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
        self,
        model: str,
        group_idx: int,
        hashes: Sequence[bytes],
        granularity: Granularity = "block",
        include_silent: bool = False,
        silent_after: timedelta | None = None,
    ) -> list[Holder]: ...

    def match_tokens(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
        self,
        model: str,
        group_idx: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        include_silent: bool = False,
        silent_after: timedelta | None = None,
        cache_salt: str | None = None,
    ) -> list[Holder]: ...

    def match_at(
        self,
        model: str,
        group_idx: int,
        hashes: Sequence[bytes],
        at: datetime,
        granularity: Granularity = "block",
    ) -> list[Holder]: ...

    def state_checkpoints(
        self, model: str, group_idx: int, hashes: Sequence[bytes], upto: Mapping[str, int]
    ) -> dict[str, int]: ...

    def knows_group(self, model: str, group_idx: int) -> bool: ...

    def loads(self, model: str, silent_after: timedelta | None = None) -> list[EngineLoad]: ...

    def blocks(self, block_hash: bytes) -> list[Block]: ...


class PrefixIndex:
    """Prefix lookups on one database connection (:class:`PrefixLookups` over SQL)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def _holders(
        self, function: str, params: tuple[object, ...], state: str = "'live'"
    ) -> list[Holder]:
        # Hash arrays travel in binary: text-escaping 128 bytea values costs more than the
        # lookup's index probes.
        placeholders = ", ".join("%b" if isinstance(p, list) else "%s" for p in params)
        rows = self.conn.execute(
            f"SELECT instance, medium, ownership, matched_blocks, matched_tokens, {state} "
            f"FROM kvledger.{function}({placeholders}) "
            "ORDER BY matched_tokens DESC NULLS LAST, matched_blocks DESC, "
            "instance, medium, ownership",
            params,
        ).fetchall()
        return [Holder(i, m, o, b, int(t or 0), st) for i, m, o, b, t, st in rows]

    def match(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
        self,
        model: str,
        group_idx: int,
        hashes: Sequence[bytes],
        granularity: Granularity = "block",
        include_silent: bool = False,
        silent_after: timedelta | None = None,
    ) -> list[Holder]:
        """Holders of the longest run of ``hashes`` from the start, now.

        ``granularity="block"``: one hash per block, as the events announce them.
        ``"hash"``: the prompt's hashes at the group's hash size (what the engine computes);
        partial tails then extend a match past the last full block, in tokens.
        Holders whose source is not live are left out unless ``include_silent``;
        ``silent_after`` overrides the database's window (kvledger.silent_after, 30 s).
        """
        _check(granularity)
        params = (model, group_idx, list(hashes), granularity, include_silent, silent_after)
        return self._holders("match_prefix", params, "source_state")

    def match_at(
        self,
        model: str,
        group_idx: int,
        hashes: Sequence[bytes],
        at: datetime,
        granularity: Granularity = "block",
    ) -> list[Holder]:
        """The same answer as of ``at``, from the residency history (no liveness filter:
        every holder's ``source_state`` is ``as_of``). A time before the retained history
        raises :class:`NotRetainedError`, which says where it starts."""
        _check(granularity)
        params = (model, group_idx, list(hashes), at, granularity)
        try:
            return self._holders("match_prefix_at", params, "'as_of'")
        except psycopg.errors.InvalidParameterValue as exc:
            raise NotRetainedError(exc.diag.message_primary or str(exc)) from None

    def match_tokens(  # noqa: PLR0913 - the SQL lookup function's parameters, one for one
        self,
        model: str,
        group_idx: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        include_silent: bool = False,
        silent_after: timedelta | None = None,
        cache_salt: str | None = None,
    ) -> list[Holder]:
        """The same answer found by walking the hash chain by token content; a salted
        prompt's walk (``cache_salt``) starts at the first blocks of that salt."""
        params = (
            model,
            group_idx,
            list(token_ids),
            lora_name,
            include_silent,
            silent_after,
            cache_salt,
        )
        return self._holders("match_tokens", params, "source_state")

    def state_checkpoints(
        self, model: str, group_idx: int, hashes: Sequence[bytes], upto: Mapping[str, int]
    ) -> dict[str, int]:
        """For each instance of ``upto`` (instance -> how many leading blocks of the prompt
        it holds in the attention group), the deepest position within that prefix at whose
        hash it holds a state checkpoint in recurrent group ``group_idx`` (any tier; absent:
        none). A hybrid model's prefix is reusable up to there."""
        top = min(max(upto.values(), default=0), len(hashes))
        if top == 0:
            return {}
        rows = self.conn.execute(
            "SELECT DISTINCT r.instance, p.pos "
            "FROM unnest(%b::bytea[]) WITH ORDINALITY AS p(hash, pos) "
            "JOIN kvledger.residencies r ON r.model = %s AND r.group_idx = %s "
            "AND r.block_hash = p.hash WHERE r.instance = ANY(%s)",
            (list(hashes[:top]), model, group_idx, list(upto)),
        ).fetchall()
        return deepest_states(((instance, int(pos)) for instance, pos in rows), upto)

    def knows_group(self, model: str, group_idx: int) -> bool:
        """Whether the index has a spec (declared or announced) for (model, group)."""
        row = self.conn.execute(
            "SELECT 1 FROM kvledger.group_specs WHERE model = %s AND group_idx = %s",
            (model, group_idx),
        ).fetchone()
        return row is not None

    def loads(self, model: str, silent_after: timedelta | None = None) -> list[EngineLoad]:
        """The load of each live source of ``model`` that has said one (its relay reads the
        engine's metrics), by instance."""
        rows = self.conn.execute(
            "SELECT s.source, s.requests_running, s.requests_waiting, s.load_at "
            "FROM kvledger.sources s JOIN kvledger.source_states(%s) st USING (source) "
            "WHERE s.model = %s AND s.load_at IS NOT NULL AND st.state = 'live' "
            "ORDER BY s.source",
            (silent_after, model),
        ).fetchall()
        return [EngineLoad(*row) for row in rows]

    def holders(self, model: str, group_idx: int, block_hash: bytes) -> list[Residency]:
        rows = self.conn.execute(
            "SELECT instance, medium, ownership, locality, since, refcount "
            "FROM kvledger.residencies WHERE model = %s AND group_idx = %s AND block_hash = %s "
            "ORDER BY instance, medium, ownership",
            (model, group_idx, block_hash),
        ).fetchall()
        return [Residency(*row) for row in rows]

    def blocks(self, block_hash: bytes) -> list[Block]:
        """Every (model, group) row of a hash, with its current holders."""
        rows = self.conn.execute(
            "SELECT model, group_idx, block_hash, parent_hash, token_start, token_end, "
            "block_size, partial, lora_name, first_seen, last_seen FROM kvledger.blocks "
            "WHERE block_hash = %s ORDER BY model, group_idx",
            (block_hash,),
        ).fetchall()
        out = []
        for m, g, h, p, start, end, size, partial, lora, first, last in rows:
            out.append(
                Block(
                    m,
                    g,
                    bytes(h),
                    bytes(p) if p is not None else None,
                    start,
                    end,
                    size,
                    partial,
                    lora,
                    first,
                    last,
                    tuple(self.holders(m, g, bytes(h))),
                )
            )
        return out


def tied(ranked: Sequence[Ranked]) -> list[str]:
    """The instances that share the best score of ``ranked`` (rank's order): one when the
    best is alone, none when nothing ranks."""
    return [r.instance for r in ranked if r.score == ranked[0].score] if ranked else []


def rank(
    holders: Sequence[Holder], weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS
) -> list[Ranked]:
    """Rank instances for routing: each matched token counts its best tier's weight.

    An instance's score is the sum over tokens of the highest weight among the tiers that
    hold that token (tiers hold nested prefixes, so this is a sum over tier increments).
    """
    by_instance: dict[str, dict[str, int]] = {}
    for h in holders:
        tiers = by_instance.setdefault(h.instance, {})
        tiers[h.medium] = max(tiers.get(h.medium, 0), h.matched_tokens)
    ranked = []
    for instance, tiers in by_instance.items():
        score, covered = 0.0, 0
        for medium, tokens in sorted(tiers.items(), key=lambda kv: -weights.get(kv[0], 0.0)):
            if tokens > covered:
                score += (tokens - covered) * weights.get(medium, 0.0)
                covered = tokens
        ranked.append(Ranked(instance, score, dict(tiers)))
    ranked.sort(key=lambda r: (-r.score, r.instance))
    return ranked
