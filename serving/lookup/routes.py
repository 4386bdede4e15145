"""What the lookup service's routes answer, apart from HTTP: where a lookup is answered (the
database, through a pool of read-only connections, or a RouterIndex in memory), the answers
of /v1/match, /v1/blocks/{hash} and /healthz, and every error a lookup can meet as the answer
that says why (:func:`error_answer`). :mod:`.table` routes to them and :mod:`.door` serves
them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, fields
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from kvledger.consumer.db import (
    SCHEMA_MISSING,
    SCHEMA_MISSING_ERRORS,
    SchemaMissingError,
    conninfo,
)
from kvledger.consumer.roles import WriterRoleError, ensure_read_only
from kvledger.schemas.decisions import HASHES, TOKENS, Decision
from kvledger.schemas.lookup import Block, EngineLoad, Holder
from kvledger.schemas.redact import redact
from kvledger.serving.lookup import dashboard
from kvledger.serving.lookup.api import (
    NotRetainedError,
    PrefixIndex,
    PrefixLookups,
    rank,
    split_live,
    unknown_group,
)
from kvledger.serving.lookup.dynamo_requests import DynamoRequestError
from kvledger.serving.lookup.metrics import CAPTURED_FRACTION, DECISION_BLOCKS
from kvledger.serving.lookup.offer import offer_record
from kvledger.serving.lookup.requests import (
    BadRequestError,
    MatchRequest,
    parse_decision,
    parse_json,
    parse_match,
    parse_path_hash,
)
from kvledger.serving.router import provisional as pv
from kvledger.serving.router.match import holder_order

if TYPE_CHECKING:
    from kvledger.serving.lookup.config import ServiceConfig
    from kvledger.serving.router.index import RouterIndex

logger = logging.getLogger(__name__)

# A route's answer: status, JSON body, extra headers.
Answer = tuple[int, Any, dict[str, str]]

# Whether the server is a hot standby, and its replay lag: the time since the last replayed
# transaction committed on the primary, 0 when it has replayed everything it received.
_STANDBY = """
SELECT pg_is_in_recovery(),
       CASE WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN interval '0'
            ELSE now() - pg_last_xact_replay_timestamp() END,
       pg_last_wal_replay_lsn()
"""


def error_answer(route: str, exc: Exception) -> Answer:
    """The answer that says why route ``route`` failed with ``exc``: the request's fault
    (400, or Dynamo's own status), history not retained (410), the database busy, slow or
    missing (503 with Retry-After), else a bug (500, logged)."""
    if isinstance(exc, DynamoRequestError):
        return exc.status, {"error": str(exc)}, {}
    if isinstance(exc, BadRequestError):
        return 400, {"error": str(exc)}, {}
    if isinstance(exc, NotRetainedError):  # the history asked about is gone, for good
        return 410, {"error": str(exc)}, {}
    if isinstance(exc, PoolTimeout):
        return 503, {"error": "no database connection free"}, {"Retry-After": "1"}
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return 503, {"error": "the lookup ran past the statement timeout"}, {"Retry-After": "1"}
    if isinstance(exc, SCHEMA_MISSING_ERRORS):
        return 503, {"error": SCHEMA_MISSING}, {"Retry-After": "30"}
    if isinstance(exc, WriterRoleError):
        return 503, {"error": str(exc)}, {"Retry-After": "30"}
    if isinstance(exc, psycopg.OperationalError):
        return 503, {"error": f"database unavailable: {redact(str(exc))}"}, {"Retry-After": "5"}
    # a bug: answered and counted as a 500, never a dropped request
    logger.error("route %s failed", route, exc_info=exc)
    return 500, {"error": "internal error"}, {}


class Lookups:
    """The routes' answers, from ``config.router`` in memory or else from the database at
    ``config.database_url`` (through a pool of ``pool_size`` read-only connections, opened
    by :meth:`open`); ``silent_after``: the liveness window where a request gives none.

    A lookup that runs past ``statement_timeout_ms`` or waits more than ``pool_timeout_s``
    for a connection raises (a 503 through :func:`error_answer`). The database role must not be
    able to write to the index (:class:`WriterRoleError`, raised here) unless
    ``allow_writer``; on a database not migrated yet (the service started first, as
    containers may) it is checked again before each lookup until the schema is there, and
    until then every lookup is a 503 that says why."""

    def __init__(self, config: ServiceConfig) -> None:
        database_url, router, provisional = config.database_url, config.router, config.provisional
        if database_url is None and router is None:
            raise ValueError("create_app needs a database URL or a router")
        if provisional is not None and router is None:
            raise ValueError("provisional holders are answered from memory: they need a router")
        statement_timeout_ms = config.statement_timeout_ms
        self.router = router
        self.provisional = provisional
        self.share = config.share  # the other replicas are told (a DecisionLog's publish)
        self.silent_after = config.silent_after
        self.pool_timeout_s = config.pool_timeout_s
        # Computed and encoded once per refresh, not per tab.
        self.dashboards: dashboard.SharedAnswers[dict[str, Any]] = dashboard.SharedAnswers(
            keep=len(dashboard.WINDOWS)
        )
        self.database_url = database_url
        self.pool = (
            ConnectionPool(
                conninfo(database_url),
                min_size=1,
                max_size=config.pool_size,
                configure=lambda conn: _configure(conn, statement_timeout_ms),
                kwargs={"autocommit": True},
                open=False,
            )
            if database_url is not None
            else None
        )
        self.role_unchecked = database_url is not None and not config.allow_writer
        if self.role_unchecked:
            try:
                self._check_role()
            except SchemaMissingError:
                logger.warning("%s; until then every lookup is answered 503", SCHEMA_MISSING)

    def open(self) -> None:
        if self.pool is not None:
            self.pool.open()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _check_role(self) -> None:
        if self.role_unchecked:
            assert self.database_url is not None
            ensure_read_only(self.database_url)  # SchemaMissingError, WriterRoleError: a 503
            self.role_unchecked = False

    @contextmanager
    def index(self) -> Iterator[PrefixLookups]:
        """The lookup API: over the router, or a PrefixIndex on a pooled connection."""
        if self.router is not None:
            yield _MemoryLookups(self.router)
            return
        with self.sql() as idx:
            yield idx

    @contextmanager
    def sql(self) -> Iterator[PrefixIndex]:
        """A PrefixIndex on a pooled connection (the SQL service's own questions)."""
        assert self.pool is not None
        self._check_role()
        with self.pool.connection(timeout=self.pool_timeout_s) as conn:
            yield PrefixIndex(conn)

    def _window(self, req: MatchRequest) -> timedelta | None:
        return req.silent_after if req.silent_after is not None else self.silent_after

    def match(self, raw: bytes) -> Answer:
        """POST /v1/match: the holders of a prompt, ranked, and those left out as silent."""
        req = parse_match(parse_json(raw))
        left_out: list[Holder] = []
        with self.index() as idx:
            if req.token_ids is not None:
                holders = idx.match_tokens(
                    req.model,
                    req.group_idx,
                    req.token_ids,
                    req.lora_name,
                    True,
                    self._window(req),
                    req.cache_salt,
                )
            elif req.at is not None:
                assert req.hashes is not None
                holders = idx.match_at(
                    req.model, req.group_idx, req.hashes, req.at, req.granularity
                )
            else:
                assert req.hashes is not None
                holders = idx.match(
                    req.model,
                    req.group_idx,
                    req.hashes,
                    req.granularity,
                    True,
                    self._window(req),
                )
            # Only an empty answer asks whether the group is known: a hit pays nothing.
            unknown = not holders and not idx.knows_group(req.model, req.group_idx)
            states = None
            if req.state_group is not None:
                assert req.hashes is not None
                upto = _blocks_by_instance(holders)
                states = idx.state_checkpoints(req.model, req.state_group, req.hashes, upto)
            loads = idx.loads(req.model, self._window(req)) if req.load else None
        if self.provisional is not None and req.at is None and req.granularity == "block":
            holders = self._with_provisional(req, holders)
        if req.at is None and not req.include_silent:
            holders, left_out = split_live(holders)
        ranked = rank(holders, req.weights)
        body: dict[str, Any] = {
            "holders": [_holder_json(h) for h in holders],
            "ranked": [_holder_json(r) for r in ranked],
            "left_out": [_holder_json(h) for h in left_out],
        }
        if unknown:
            body["unknown_group"] = unknown_group(req.model, req.group_idx)
        if states is not None:
            body["state_checkpoints"] = states
        if self.provisional is not None:
            body["in_flight"] = self.provisional.in_flight()
        if loads is not None:
            body["load"] = _loads_json(loads, datetime.now(UTC))
        return 200, body, {}

    def _with_provisional(self, req: MatchRequest, holders: list[Holder]) -> list[Holder]:
        """``holders`` and, where a router's decision says more than the index holds, the
        instances it sent this prompt to (marked provisional, counted on the GPU tier)."""
        assert self.provisional is not None and self.router is not None
        kind = TOKENS if req.token_ids is not None else HASHES
        if self.provisional.empty(req.model, req.group_idx, kind):
            return holders  # nothing reported for this group: nothing to pay
        block_size = self.router.block_size(req.model, req.group_idx)
        if block_size is None:
            return holders
        if req.token_ids is not None:
            keys = pv.token_keys(req.token_ids, block_size, req.lora_name, req.cache_salt)
        else:
            assert req.hashes is not None
            keys = pv.hash_keys(req.hashes)
        real = _blocks_by_instance(holders)
        depths = self.provisional.depths(req.model, req.group_idx, kind, keys, real)
        if not depths:
            return holders
        states = self.router.states(list(depths), self._window(req))
        extra = [
            Holder(instance, "GPU", "", n, n * block_size, states[instance], provisional=True)
            for instance, n in depths.items()
        ]
        return sorted([*holders, *extra], key=holder_order)

    def decide(self, raw: bytes) -> Answer:
        """POST /v1/decisions: a router sent a prompt to an instance; held as a provisional
        holder of the prompt's blocks (and shared with the other replicas)."""
        if self.provisional is None or self.router is None:
            raise BadRequestError(
                "decisions are held by the memory-backed service (kvledger serve --memory)"
            )
        req = parse_decision(parse_json(raw))
        block_size = self.router.block_size(req.model, req.group_idx)
        if block_size is None:
            raise BadRequestError(
                f"model/group_idx: no group {req.model!r}/{req.group_idx} in the index"
            )
        state = self.router.states([req.instance], self.silent_after)[req.instance]
        if state in ("unknown", "closed"):
            why = "has sent no events" if state == "unknown" else "said goodbye"
            raise BadRequestError(f"instance: {req.instance!r} {why}")
        if req.token_ids is not None:
            kind = TOKENS
            keys = pv.token_keys(req.token_ids, block_size, req.lora_name, req.cache_salt)
        else:
            assert req.hashes is not None
            kind, keys = HASHES, pv.hash_keys(req.hashes)
        decision = Decision(
            req.model, req.group_idx, req.instance, kind, tuple(keys), request_id=req.request_id
        )
        held = self.provisional.add(decision)
        if self.share is not None:  # the other replicas, and the record for the funnel
            record = offer_record(self.router, req, block_size, state, self.silent_after)
            self.share(decision, record)
            DECISION_BLOCKS.labels("prompt").inc(record.prompt_blocks)
            DECISION_BLOCKS.labels("available").inc(record.available_blocks)
            captured = record.captured_blocks or 0  # a decision's: never None
            DECISION_BLOCKS.labels("captured").inc(captured)
            if record.available_blocks:
                CAPTURED_FRACTION.observe(captured / record.available_blocks)
        return (
            202,
            {
                "instance": req.instance,
                "provisional_blocks": held,
                "expires_in_s": self.provisional.ttl_s,
            },
            {},
        )

    def dashboard(self, params: dict[str, str]) -> Answer:
        """GET /v1/dashboard: the fleet at a glance (serving/lookup/dashboard.py)."""
        minutes = dashboard.minutes_of(params)
        window = dashboard.window_of(minutes)  # a few windows computed, each cut from one

        def compute() -> dict[str, Any]:
            if self.router is not None:
                return dashboard.from_memory(self.router, window, self.silent_after)
            with self.sql() as idx:
                return dashboard.from_database(idx.conn, window)

        answer = self.dashboards.get(window, compute)
        return 200, dashboard.encoded(dashboard.cut(answer, minutes)), {}

    def block(self, params: Mapping[str, str]) -> Answer:
        """GET /v1/blocks/{hash}: the block rows of a hash and their holders."""
        rows = []
        with self.index() as idx:
            for h in parse_path_hash(params["block_hash"]):  # the likeliest reading first
                if rows := idx.blocks(h):
                    break
        if not rows:
            return 404, {"error": "unknown block hash"}, {}
        return 200, [_block_json(b) for b in rows], {}

    def healthz(self, _: object) -> Answer:
        """GET /healthz: the database answers (and a standby's replay lag), or in memory
        the router's log position (503 once its tail stopped)."""
        if self.router is not None:
            position = self.router.position()
            status = "ok" if position.error is None else "stopped"
            body = {"status": status, "mode": "memory", "position": asdict(position)}
            return (200 if position.error is None else 503), body, {}
        with self.sql() as idx:
            idx.conn.execute("SELECT 1 FROM kvledger.group_specs LIMIT 1")
            row = idx.conn.execute(_STANDBY).fetchone()
        if row is None or not row[0]:
            return 200, {"status": "ok"}, {}
        # A hot standby: how far its replay is behind (None before any replayed commit).
        lag = row[1]
        return (
            200,
            {
                "status": "ok",
                "standby": True,
                "replay_lag_s": lag.total_seconds() if lag is not None else None,
                "replay_lsn": str(row[2]) if row[2] is not None else None,
            },
            {},
        )


class _MemoryLookups:
    """:class:`PrefixLookups` over a RouterIndex (no history, no block rows: a 400 each)."""

    def __init__(self, router: RouterIndex) -> None:
        self.router = router
        self.match = router.match
        self.match_tokens = router.match_tokens
        self.state_checkpoints = router.state_checkpoints
        self.knows_group = router.knows_group
        self.loads = router.loads

    def match_at(self, *args: object, **kwargs: object) -> list[Holder]:
        raise BadRequestError("as-of lookups are served by the SQL-backed service")

    def blocks(self, block_hash: bytes) -> list[Block]:
        raise BadRequestError("block rows are served by the SQL-backed service")


def _loads_json(loads: list[EngineLoad], now: datetime) -> dict[str, dict[str, Any]]:
    """Each engine's load as the answer gives it: its counts and how old they are."""
    return {
        load.instance: {
            "running": load.running,
            "waiting": load.waiting,
            "age_s": round(max((now - load.at).total_seconds(), 0.0), 3),
        }
        for load in loads
    }


def _blocks_by_instance(holders: list[Holder]) -> dict[str, int]:
    """Each instance's longest match in blocks, over its tiers."""
    out: dict[str, int] = {}
    for h in holders:
        out[h.instance] = max(out.get(h.instance, 0), h.matched_blocks)
    return out


def _configure(conn: psycopg.Connection, statement_timeout_ms: int) -> None:
    conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    # Last: it bounds every later statement, the set-up's own included.
    conn.execute(f"SET statement_timeout = {int(statement_timeout_ms)}")


_FIELDS: dict[type, tuple[str, ...]] = {}


def _holder_json(h: Any) -> dict[str, Any]:
    """A Holder or Ranked as JSON (dataclasses.asdict, without its deep copy: ~4x faster);
    ``provisional`` only where true (the answers of an index no router reports to are
    as they were)."""
    names = _FIELDS.get(type(h))
    if names is None:
        names = _FIELDS[type(h)] = tuple(f.name for f in fields(h) if f.name != "provisional")
    out = {name: getattr(h, name) for name in names}
    if getattr(h, "provisional", False):
        out["provisional"] = True
    return out


def _block_json(b: Any) -> dict[str, Any]:
    d = asdict(b)
    d["block_hash"] = b.block_hash.hex()
    d["parent_hash"] = b.parent_hash.hex() if b.parent_hash is not None else None
    for key in ("first_seen", "last_seen"):
        d[key] = d[key].isoformat()
    for holder in d["holders"]:
        holder["since"] = holder["since"].isoformat()
    return d
