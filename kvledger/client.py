"""A small typed client of the lookup service's HTTP API (see GET /openapi.json).

Standard library only, so a router imports it from the base install::

    from kvledger.client import LookupClient

    with LookupClient("http://127.0.0.1:8080", token="...") as lookups:
        answer = lookups.match("llama-3-8b", hashes=prompt_hashes)
        best = answer.ranked[0].instance if answer.ranked else None

One keep-alive connection per client (not thread-safe: one client per thread). A refusal
raises :class:`LookupServiceError` with the service's status, reason and Retry-After.

A router that tells the service where it sent each prompt (``POST /v1/decisions``) does it
off the request's path with a :class:`DecisionReporter` (thread-safe, one per service)::

    reporter = DecisionReporter("http://127.0.0.1:8080")
    ...
    reporter.report("llama-3-8b", chosen_instance, token_ids=prompt_tokens)  # never waits
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Literal

# The same answer types as the Python API's (kvledger.serving.lookup).
from kvledger.schemas.lookup import Block, Holder, Ranked, Residency

__all__ = [
    "Block",
    "DecisionReporter",
    "Holder",
    "LookupClient",
    "LookupServiceError",
    "MatchAnswer",
    "Ranked",
    "ReporterStats",
    "Residency",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MatchAnswer:
    holders: list[Holder]
    ranked: list[Ranked]
    left_out: list[Holder]
    # Set when the answer is empty because the index has no spec for the model and group
    # asked (a mistyped name, or engines that have not announced it yet): why, in words.
    unknown_group: str | None = None
    # Memory mode: per instance, decisions routed there that its engine has not confirmed.
    in_flight: dict[str, int] | None = None
    # Asked with load=True: per live engine that reports one, {"running", "waiting",
    # "age_s"}: the requests its engine was running and had queued, and how old that is.
    load: dict[str, dict[str, Any]] | None = None


class LookupServiceError(Exception):
    """The service answered with an error: ``status``, its ``reason``, and for a 503 the
    seconds to wait (``retry_after``). ``status`` 0: no answer at all (nothing listening,
    a timeout, a TLS failure); ``reason`` says which."""

    def __init__(self, status: int, reason: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class LookupClient:
    """The lookup service at ``base_url`` (http:// or https://); ``token`` for a service run
    with --token-file; ``ssl_context`` to trust a private CA."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._prefix = url.path.rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection
        if url.scheme == "https":
            self._conn = http.client.HTTPSConnection(
                url.hostname, url.port, timeout=timeout, context=ssl_context
            )
        else:
            self._conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)

    def match(  # noqa: PLR0913 - the lookup API's query parameters, one keyword each
        self,
        model: str,
        hashes: Sequence[bytes | int | str] | None = None,
        token_ids: Sequence[int] | None = None,
        group_idx: int = 0,
        granularity: Literal["block", "hash"] = "block",
        lora_name: str | None = None,
        at: datetime | None = None,
        weights: Mapping[str, float] | None = None,
        include_silent: bool = False,
        silent_after_s: float | None = None,
        cache_salt: str | None = None,
        load: bool = False,
    ) -> MatchAnswer:
        """POST /v1/match: by block hashes (bytes, vLLM's int form, or hex) or token ids
        (``cache_salt``: the salt the engine hashed a salted prompt with; ``load``: the
        answer also gives each live engine's load)."""
        body: dict[str, Any] = {"model": model, "group_idx": group_idx}
        if hashes is not None:
            body["hashes"] = [h.hex() if isinstance(h, bytes) else h for h in hashes]
            body["granularity"] = granularity
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        for key, value in (
            ("lora_name", lora_name),
            ("weights", weights),
            ("silent_after_s", silent_after_s),
            ("cache_salt", cache_salt),
        ):
            if value is not None:
                body[key] = dict(value) if isinstance(value, Mapping) else value
        if at is not None:
            body["at"] = at.isoformat()
        if include_silent:
            body["include_silent"] = True
        if load:
            body["load"] = True
        data = self._request("POST", "/v1/match", body)
        return MatchAnswer(
            holders=[Holder(**h) for h in data["holders"]],
            ranked=[Ranked(**r) for r in data["ranked"]],
            left_out=[Holder(**h) for h in data["left_out"]],
            unknown_group=data.get("unknown_group"),
            in_flight=data.get("in_flight"),
            load=data.get("load"),
        )

    def decide(  # noqa: PLR0913 - POST /v1/decisions' fields, one keyword each
        self,
        model: str,
        instance: str,
        token_ids: Sequence[int] | None = None,
        hashes: Sequence[bytes | int | str] | None = None,
        group_idx: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> int:
        """POST /v1/decisions: the prompt went to ``instance``; the service answers it as a
        provisional holder of the prompt's full blocks for a short window. Returns the
        number of blocks held."""
        body = decision_body(
            model, instance, token_ids, hashes, group_idx, lora_name, cache_salt, request_id
        )
        held: int = self._request("POST", "/v1/decisions", body)["provisional_blocks"]
        return held

    def blocks(self, block_hash: bytes | int | str) -> list[Block]:
        """GET /v1/blocks/{hash}: the index's rows of one hash ([] when it has none)."""
        key = block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)
        try:
            rows = self._request("GET", f"/v1/blocks/{urllib.parse.quote(key)}")
        except LookupServiceError as exc:
            if exc.status == 404:
                return []
            raise
        return [_block(row) for row in rows]

    def healthz(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/healthz")
        return result

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> LookupClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _request(self, method: str, path: str, body: object = None) -> Any:
        payload = None if body is None else json.dumps(body).encode()
        for attempt in (1, 2):  # once more on a keep-alive connection the server had closed
            try:
                self._conn.request(method, self._prefix + path, payload, self._headers)
                response = self._conn.getresponse()
                raw = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self._conn.close()
                if attempt == 2:
                    raise self._unreachable(exc) from exc
            except (OSError, http.client.HTTPException) as exc:  # refused, timed out, TLS
                self._conn.close()
                raise self._unreachable(exc) from exc
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        if response.status >= 400:
            reason = (
                data.get("error", "")
                if isinstance(data, dict)
                else (raw.decode("utf-8", "replace")[:200])
            )
            retry = response.getheader("Retry-After")
            raise LookupServiceError(response.status, reason, float(retry) if retry else None)
        return data

    def _unreachable(self, exc: BaseException) -> LookupServiceError:
        where = f"{self._conn.host}:{self._conn.port}"
        return LookupServiceError(0, f"no answer from the lookup service at {where}: {exc}")


@dataclass(frozen=True, slots=True)
class ReporterStats:
    """What a :class:`DecisionReporter` did with the decisions it was given."""

    reported: int  # given to report()
    sent: int  # the service held them
    dropped: int  # the queue was full: each made room for a newer decision
    expired: int  # older than max_age_s when their turn came: not sent
    failed: int  # the service refused them or did not answer (not retried)
    last_error: str | None  # why the last failure failed


class DecisionReporter:
    """Tells the lookup service where a router sent each prompt (``POST /v1/decisions``)
    without the request waiting for it: :meth:`report` queues the decision and returns, and
    one thread sends the queue in order over a keep-alive connection of its own.

    A decision is worth something only until the engine's own events confirm its blocks,
    seconds later, so nothing waits on a slow or absent service and nothing piles up: a
    full queue (``capacity``) drops its oldest decision, a decision older than ``max_age_s``
    when its turn comes is dropped unsent (the service would hold it from when it arrives,
    for longer than it is true), and one the service refuses or does not answer within
    ``timeout`` is counted and not retried. :attr:`stats` counts each outcome; the first
    failure after a success is logged, with the service's reason.
    """

    def __init__(  # noqa: PLR0913 - LookupClient's four, then its queue's two
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 2.0,
        ssl_context: ssl.SSLContext | None = None,
        capacity: int = 1024,
        max_age_s: float = 1.0,
    ) -> None:
        if capacity < 1 or max_age_s <= 0:
            raise ValueError(f"capacity {capacity} and max_age_s {max_age_s} must be positive")
        self._client = LookupClient(base_url, token, timeout, ssl_context)
        self._capacity, self._max_age = capacity, max_age_s
        self._queue: deque[tuple[float, dict[str, Any]]] = deque()
        self._cond = threading.Condition()
        self._sending = self._closed = False
        self._counts = {"reported": 0, "sent": 0, "dropped": 0, "expired": 0, "failed": 0}
        self._last_error: str | None = None
        self._sent_at_error = -1  # the sent count at the last failure
        self._thread = threading.Thread(target=self._run, name="kvledger-decisions", daemon=True)
        self._thread.start()

    def report(  # noqa: PLR0913 - decide's fields, as LookupClient.decide takes them
        self,
        model: str,
        instance: str,
        token_ids: Sequence[int] | None = None,
        hashes: Sequence[bytes | int | str] | None = None,
        group_idx: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Queue a decision (as :meth:`LookupClient.decide` takes it) and return at once."""
        body = decision_body(
            model, instance, token_ids, hashes, group_idx, lora_name, cache_salt, request_id
        )
        with self._cond:
            if self._closed:
                raise RuntimeError("DecisionReporter.report() after close()")
            self._counts["reported"] += 1
            if len(self._queue) >= self._capacity:
                self._queue.popleft()
                self._counts["dropped"] += 1
            self._queue.append((time.monotonic(), body))
            self._cond.notify_all()

    @property
    def stats(self) -> ReporterStats:
        with self._cond:
            return ReporterStats(**self._counts, last_error=self._last_error)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every decision reported so far has been sent, dropped, expired or
        failed (False: the ``timeout`` passed first)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._sending, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (what is not too old), then stop; waits at most ``timeout``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def __enter__(self) -> DecisionReporter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:  # closed, and everything handled
                    break
                queued_at, body = self._queue.popleft()
                if time.monotonic() - queued_at > self._max_age:
                    self._counts["expired"] += 1
                    self._cond.notify_all()
                    continue
                self._sending = True
            error = None
            try:
                self._client._request("POST", "/v1/decisions", body)
            except Exception as exc:
                error = str(exc) or type(exc).__name__
            with self._cond:
                self._sending = False
                if error is None:
                    self._counts["sent"] += 1
                else:
                    if self._counts["sent"] > self._sent_at_error:  # a new run of failures
                        logger.warning("decisions not reported to the lookup service: %s", error)
                    self._counts["failed"] += 1
                    self._last_error, self._sent_at_error = error, self._counts["sent"]
                self._cond.notify_all()
        self._client.close()


def decision_body(  # noqa: PLR0913 - POST /v1/decisions' fields, as decide takes them
    model: str,
    instance: str,
    token_ids: Sequence[int] | None = None,
    hashes: Sequence[bytes | int | str] | None = None,
    group_idx: int = 0,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/decisions`` (see :meth:`LookupClient.decide`)."""
    body: dict[str, Any] = {"model": model, "group_idx": group_idx, "instance": instance}
    if hashes is not None:
        body["hashes"] = [h.hex() if isinstance(h, bytes) else h for h in hashes]
    if token_ids is not None:
        body["token_ids"] = list(token_ids)
    for key, value in (
        ("lora_name", lora_name),
        ("cache_salt", cache_salt),
        ("request_id", request_id),
    ):
        if value is not None:
            body[key] = value
    return body


def _block(row: Mapping[str, Any]) -> Block:
    parent = row["parent_hash"]
    return Block(
        model=row["model"],
        group_idx=row["group_idx"],
        block_hash=bytes.fromhex(row["block_hash"]),
        parent_hash=bytes.fromhex(parent) if parent is not None else None,
        token_start=row["token_start"],
        token_end=row["token_end"],
        block_size=row["block_size"],
        partial=row["partial"],
        lora_name=row["lora_name"],
        first_seen=datetime.fromisoformat(row["first_seen"]),
        last_seen=datetime.fromisoformat(row["last_seen"]),
        holders=tuple(
            Residency(
                h["instance"],
                h["medium"],
                h["ownership"],
                h["locality"],
                datetime.fromisoformat(h["since"]),
                h["refcount"],
            )
            for h in row["holders"]
        ),
    )
