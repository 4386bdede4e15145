"""What one lookup service is made of (:func:`~.http.create_app` takes it): where it answers
from, its token, its limits, and what it serves beside its own routes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvledger.schemas.decisions import Answered, Decision, Record
    from kvledger.serving.router.index import RouterIndex
    from kvledger.serving.router.provisional import Provisional

    # Records an answer no choice was reported for, its record built later.
    RecordAnswer = Callable[[Answered, Callable[[], Record]], None]


@dataclass(frozen=True)
class ServiceConfig:
    """One lookup service.

    From the database at ``database_url`` (a pool of ``pool_size`` read-only connections)
    or, given ``router``, from memory; ``silent_after``: the liveness window (else the
    database's, or 30 s in memory). ``token``: every route but the open ones then requires
    ``Authorization: Bearer <token>`` (401 without it). A lookup that runs past
    ``statement_timeout_ms`` or waits more than ``pool_timeout_s`` for a connection is
    answered 503 with Retry-After. The database role must not be able to write to the index
    (:class:`~kvledger.consumer.roles.WriterRoleError`, raised by ``create_app``) unless
    ``allow_writer``. ``dynamo_api``: also serve NVIDIA Dynamo's KV-indexer routes
    (:mod:`.dynamo`), from ``dynamo_router`` or else ``router`` (built with
    ``dynamo=True``): Dynamo's routes are always answered from memory. ``provisional``
    (memory mode): POST /v1/decisions holds where routers sent prompts, and lookups answer
    those instances as provisional holders; ``share`` tells the other replicas, and
    ``record_answer`` records Dynamo's answers from ``router`` (a DecisionLog's
    note_answer)."""

    database_url: str | None = None
    pool_size: int = 8
    silent_after: timedelta | None = None
    router: RouterIndex | None = None
    token: str | None = None
    statement_timeout_ms: int = 5000
    pool_timeout_s: float = 5.0
    allow_writer: bool = False
    dynamo_api: bool = False
    dynamo_router: RouterIndex | None = None
    provisional: Provisional | None = None
    share: Callable[[Decision, Record | None], None] | None = None
    record_answer: RecordAnswer | None = None
