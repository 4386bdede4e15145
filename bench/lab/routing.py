"""How the lab sends a request, and the routers it compares.

Every router gets the same requests. Two kinds: a *proxy* (vllm-router) receives the request
and picks an engine itself; a *policy* run by the lab picks the engine and the lab sends the
request there: round robin, or the same index policy in front of either Dynamo's standalone
indexer or kvledger (``POST /query`` by token ids; the best matched prefix, ties and
near-ties within one block broken by the fewest requests in flight).
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.lab import stack
from bench.lab.engines import BLOCK_SIZE, EngineSpec
from kvledger.client import DecisionReporter

MAX_TOKENS = 8


@dataclass
class Outcome:
    """One attempt at one engine (or proxy): whether it answered, and what the engine said."""

    ok: bool
    ttft: float = 0.0  # seconds from sending to the first streamed token
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the engine's own count of prefix-cache hits for this request
    error: str = ""
    # Nothing answered: no engine listened, or the engine went away before its answer began
    # (killed with the request in flight). Nothing reached the client, so it may be sent again.
    refused: bool = False


def complete(url: str, prompt: str, timeout: float = 60.0) -> Outcome:
    """A streamed completion; the engine's usage (with cached tokens) from the last chunk."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    body = json.dumps(
        {
            "model": stack.MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    began = time.monotonic()
    out = Outcome(ok=False)
    answered = False
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answered = True
        if answer.status != 200:
            out.error = f"HTTP {answer.status}: {answer.read(300)!r}"
            return out
        for raw in answer:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices") and not out.ttft:
                out.ttft = time.monotonic() - began
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = int(details.get("cached_tokens") or 0)
        out.ok = out.ttft > 0
        if not out.ok:
            out.error = "no token streamed"
    except ConnectionRefusedError:
        out.error, out.refused = "connection refused", True
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        # (http.client's RemoteDisconnected, a reset or a broken pipe are ConnectionErrors.)
        out.refused = isinstance(exc, ConnectionError) and not answered
    finally:
        out.seconds = time.monotonic() - began
        conn.close()
    return out


@dataclass
class Load:
    """Requests in flight per engine, as the lab's own sender counts them."""

    engines: int
    inflight: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.inflight = [0] * self.engines

    def least(self, candidates: list[int], turn: int) -> int:
        with self.lock:
            low = min(self.inflight[c] for c in candidates)
            tied = [c for c in candidates if self.inflight[c] == low]
        return tied[turn % len(tied)]

    def add(self, engine: int, delta: int) -> None:
        with self.lock:
            self.inflight[engine] += delta


class Router:
    """A router under test. ``proxy_url`` set: the lab sends every request there;
    otherwise ``choose`` names the engine."""

    name = "router"
    proxy_url: str | None = None

    def __init__(self, specs: list[EngineSpec], logs: Path) -> None:
        self.specs, self.logs = specs, logs
        self._turn = itertools.count()

    def start(self) -> None:
        """Start (or reset) the router before a run."""

    def restart(self) -> None:
        """The router (or its indexer) restarted mid-run: whatever it keeps in memory, gone."""

    def stop(self) -> None:
        """Stop what ``start`` started."""

    def choose(self, token_ids: list[int], load: Load, exclude: set[int]) -> int:
        raise NotImplementedError

    def turn(self) -> int:
        return next(self._turn)


class RoundRobin(Router):
    name = "round_robin"

    def choose(self, token_ids: list[int], load: Load, exclude: set[int]) -> int:
        order = [e for e in range(len(self.specs)) if e not in exclude] or [0]
        return order[self.turn() % len(order)]


class Served(Router):
    """A router that is a process of its own: started fresh for each run, killed and
    started again by the router-restart fault."""

    process: stack.Process
    health_url = ""

    def start(self) -> None:
        self.process.stop()
        self.process.start().wait_http(self.health_url, timeout=90)
        self.ready()

    def ready(self) -> None:
        """What the router needs once it answers (nothing, unless a subclass says)."""

    def restart(self) -> None:
        self.process.kill()
        self.start()

    def stop(self) -> None:
        self.process.stop()


class VllmRouter(Served):
    """vllm-router 0.1.17 with one of its policies, restarted fresh for each run."""

    def __init__(
        self, specs: list[EngineSpec], logs: Path, policy: str, port: int,
        republished: bool = False, tag: str = "",
    ) -> None:  # fmt: skip
        """``republished``: kv_aware hears `kvledger republish`, not the engines; ``tag``
        tells replicas' logs apart."""
        super().__init__(specs, logs)
        self.policy = policy
        self.name = f"vllm-router {policy}" + (" via kvledger" if republished else "")
        self.process = stack.vllm_router(
            f"vllm-router-{policy}{'-kvledger' if republished else ''}{tag}", policy, specs,
            port, logs, republished,
        )  # fmt: skip
        self.proxy_url = f"http://127.0.0.1:{port}"
        self.health_url = f"{self.proxy_url}/health"


class Replicas(Router):
    """Replicas of a proxying router behind a round-robin balancer, as a fleet runs more
    than one: each sees every n-th request and keeps its own state. The router-restart
    fault restarts one of them (a rolling restart)."""

    def __init__(self, replicas: list[VllmRouter]) -> None:
        super().__init__(replicas[0].specs, replicas[0].logs)
        self.replicas = replicas
        self.name = f"{replicas[0].name} x{len(replicas)}"
        self._next = itertools.count()
        self._lock = threading.Lock()

    @property  # type: ignore[override]
    def proxy_url(self) -> str | None:
        with self._lock:
            k = next(self._next)
        return self.replicas[k % len(self.replicas)].proxy_url

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def restart(self) -> None:
        self.replicas[0].restart()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


class IndexPolicy(Router):
    """The lab's one index policy in front of an indexer that answers Dynamo's ``/query``."""

    query_url = ""

    def candidates(self, exclude: set[int]) -> list[int]:
        return [e for e in range(len(self.specs)) if e not in exclude]

    def choose(self, token_ids: list[int], load: Load, exclude: set[int]) -> int:
        return self.choose_at(self.query_url, token_ids, load, exclude)

    def choose_at(self, url: str, token_ids: list[int], load: Load, exclude: set[int]) -> int:
        """:meth:`choose`, asking the indexer at ``url``."""
        allowed = (
            self.candidates(exclude)
            or [e for e in range(len(self.specs)) if e not in exclude]
            or [0]
        )
        try:
            answer = stack.post_json(
                f"{url}/query", {"token_ids": token_ids, "model_name": stack.MODEL}
            )
        except OSError:
            answer = {}  # the indexer is down (restarting): route by load alone
        scores = {
            int(w): max(ranks.values(), default=0)
            for w, ranks in (answer.get("scores") or {}).items()
        }
        best = max((scores.get(e, 0) for e in allowed), default=0)
        if best > 0:
            allowed = [e for e in allowed if scores.get(e, 0) >= best - BLOCK_SIZE]
        return load.least(allowed, self.turn())


class DynamoIndexer(Served, IndexPolicy):
    """NVIDIA Dynamo 1.6.1's standalone indexer, fed by the engines' ZMQ streams directly."""

    name = "dynamo indexer"

    def __init__(self, specs: list[EngineSpec], logs: Path, port: int) -> None:
        super().__init__(specs, logs)
        self.process = stack.dynamo_indexer(port, logs)
        self.query_url = f"http://127.0.0.1:{port}"
        self.health_url = f"{self.query_url}/workers"

    def ready(self) -> None:
        # Dynamo's way: the indexer dials each engine's PUB endpoint itself. A restarted
        # indexer is registered again, as its deployment would, and starts empty.
        stack.register_workers(self.query_url, self.specs)


class KvledgerIndex(IndexPolicy):
    """kvledger's index (``serve --memory --dynamo-api``) behind the same policy; engines it
    holds silent past its liveness window are left out, as its ``/workers`` says."""

    name = "kvledger"

    def __init__(self, specs: list[EngineSpec], logs: Path, ledger: stack.Kvledger) -> None:
        super().__init__(specs, logs)
        self.ledger = ledger
        self.query_url = ledger.url
        self._live: tuple[float, list[int]] = (0.0, [])

    def candidates(self, exclude: set[int]) -> list[int]:
        now = time.monotonic()
        if now - self._live[0] > 0.5:
            try:
                workers = stack.get_json(f"{self.query_url}/workers")
                live = [int(w["instance_id"]) for w in workers if w.get("status") == "active"]
            except OSError:  # kvledger restarting: the last view it gave, as a router keeps
                live = self._live[1] if self._live[0] else list(range(len(self.specs)))
            self._live = (now, live)
        return [e for e in self._live[1] if e not in exclude and e < len(self.specs)]

    def restart(self) -> None:
        self.ledger.restart_server()


class KvledgerDecisions(KvledgerIndex):
    """The same policy, telling kvledger where it sent each prompt (POST /v1/decisions)
    off the request's path, as a router would (kvledger.client.DecisionReporter): the engine
    chosen is a provisional holder of the prompt until its events confirm it. With
    ``replicas`` > 1, as many router replicas behind a round-robin balancer, each with a
    ``serve --memory`` of its own; the replicas share decisions through kvledger's decisions
    topic. The router-restart fault restarts the first (a rolling restart)."""

    def __init__(
        self, specs: list[EngineSpec], logs: Path, ledger: stack.Kvledger, replicas: int = 1
    ) -> None:
        super().__init__(specs, logs, ledger)
        self.urls = ledger.urls[:replicas]
        self.name = "kvledger + decisions" + (f" x{replicas}" if replicas > 1 else "")
        self._next = itertools.count()
        self._lock = threading.Lock()
        self.reporters: dict[str, DecisionReporter] = {}
        self.reported: dict[str, int] = {}

    def start(self) -> None:
        self.reporters = {url: DecisionReporter(url) for url in self.urls}

    def stop(self) -> None:
        """Each replica's reporter closed, and what became of the decisions it was given."""
        totals: dict[str, int] = {}
        for reporter in self.reporters.values():
            reporter.close()
            for key, value in asdict(reporter.stats).items():
                if isinstance(value, int):
                    totals[key] = totals.get(key, 0) + value
        self.reported = totals

    def choose(self, token_ids: list[int], load: Load, exclude: set[int]) -> int:
        with self._lock:
            url = self.urls[next(self._next) % len(self.urls)]
        engine = self.choose_at(url, token_ids, load, exclude)
        # Queued, not awaited: sent while the request goes to the engine. kvledger
        # restarting, or the engine new to it: counted in ``reported``, routed all the same.
        self.reporters[url].report(stack.MODEL, stack.source_name(engine), token_ids=token_ids)
        return engine


class KvledgerLoad(KvledgerDecisions):
    """The decisions routers' replicas, each keeping no count of its own: one
    ``POST /v1/match`` with ``"load": true`` gives the prompt's holders (provisional ones
    included) and, per engine, what kvledger knows of its load: the decisions routed there
    that its events have not confirmed (``in_flight``, every replica's) plus the requests the
    engine said it was running and had queued (``load``, from its relay's reading of the
    engine's /metrics). Ties are broken by their sum, where the other policies use the lab's
    own count of requests in flight, which a replica behind a balancer would not have."""

    def __init__(
        self, specs: list[EngineSpec], logs: Path, ledger: stack.Kvledger, replicas: int = 1
    ) -> None:
        super().__init__(specs, logs, ledger, replicas)
        self.name = "kvledger + load" + (f" x{replicas}" if replicas > 1 else "")
        self._index = {stack.source_name(i): i for i in range(len(specs))}

    def choose_at(self, url: str, token_ids: list[int], load: Load, exclude: set[int]) -> int:
        allowed = (
            self.candidates(exclude)
            or [e for e in range(len(self.specs)) if e not in exclude]
            or [0]
        )
        body = {"model": stack.MODEL, "token_ids": token_ids, "load": True}
        try:
            answer = stack.post_json(f"{url}/v1/match", body)
        except OSError:
            answer = {}  # kvledger restarting: round robin over the candidates
        scores: dict[int, int] = {}
        for holder in answer.get("holders") or ():
            e = self._index.get(holder["instance"])
            if e is not None:
                scores[e] = max(scores.get(e, 0), holder["matched_tokens"])
        best = max((scores.get(e, 0) for e in allowed), default=0)
        if best > 0:
            allowed = [e for e in allowed if scores.get(e, 0) >= best - BLOCK_SIZE]
        busy = {self._index.get(i, -1): n for i, n in (answer.get("in_flight") or {}).items()}
        for instance, said in (answer.get("load") or {}).items():
            e = self._index.get(instance, -1)
            busy[e] = busy.get(e, 0) + (said["running"] or 0) + (said["waiting"] or 0)
        low = min(busy.get(e, 0) for e in allowed)
        tied = [e for e in allowed if busy.get(e, 0) == low]
        return tied[self.turn() % len(tied)]
