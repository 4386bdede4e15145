"""The processes the lab runs beside its engines, each in its own process group with its own
log, stopped on every exit: kvledger as a user runs it (a relay per engine, the consumer,
``serve --memory --dynamo-api``, ``republish``, and the dashboard: a ``serve`` from the
database, whose ``/ui`` shows the lab's engines and its routers' decisions while it runs),
vllm-router, and Dynamo's standalone indexer.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from bench.lab import install
from bench.lab.engines import BLOCK_SIZE, EngineSpec
from bench.lab.process import LabError, Process, require_free

MODEL = "lab"
SILENT_AFTER_S = 3.0  # kvledger's liveness window in the lab (relay heartbeats every 1 s)


# Each thread keeps one keep-alive connection per service, as a router does (and as
# kvledger.client.LookupClient does): a lookup then costs its request, not a TCP handshake
# and a new urllib opener, inside every request's time to first token.
_connections = threading.local()


class ServiceError(OSError):
    """A service answered with an error status, or not in HTTP at all."""


def post_json(url: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
    return _call("POST", url, json.dumps(body).encode(), timeout)


def get_json(url: str, timeout: float = 5.0) -> Any:
    return _call("GET", url, None, timeout)


def _call(method: str, url: str, data: bytes | None, timeout: float) -> Any:
    """One JSON call on this thread's connection to the service; a connection the service
    closed while it sat idle is replaced once. Every failure is an OSError."""
    parts = urllib.parse.urlsplit(url)
    target = f"{parts.path or '/'}{'?' + parts.query if parts.query else ''}"
    held: dict[tuple[str, int], http.client.HTTPConnection] = _connections.__dict__.setdefault(
        "held", {}
    )
    key = (parts.hostname or "127.0.0.1", parts.port or 80)
    headers = {"Content-Type": "application/json"} if data is not None else {}
    for attempt in range(2):
        conn = held.get(key)
        reused = conn is not None
        if conn is None:
            conn = held[key] = http.client.HTTPConnection(*key, timeout=timeout)
        elif conn.sock is not None:
            conn.sock.settimeout(timeout)
        try:
            conn.request(method, target, body=data, headers=headers)
            answer = conn.getresponse()
            raw = answer.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            del held[key]
            if reused and isinstance(exc, ConnectionError) and attempt == 0:
                continue  # closed by the service while idle: once more, on a new connection
            if isinstance(exc, OSError):
                raise
            raise ServiceError(f"{method} {url}: {exc!r}") from exc
        if answer.will_close:
            conn.close()
            del held[key]
        if answer.status >= 400:
            raise ServiceError(f"{method} {url}: HTTP {answer.status}: {raw[:300]!r}")
        return json.loads(raw)
    raise AssertionError("unreachable")


REPLICAS = 3  # serve replicas for the routers that run as several (kvledger_decisions_x3)


def source_name(engine: int) -> str:
    return f"engine-{engine}"  # kvledger's Dynamo worker id is the number it ends in


class Kvledger:
    """kvledger in front of the engines: its own topic and database (made here, removed on
    exit), a relay per engine, the consumer (recording the routers' decisions too),
    ``serve --memory --dynamo-api``, ``republish`` (each engine's stream again, from the
    index, on the ports :attr:`EngineSpec.republished` names), and the dashboard (a
    ``serve`` from the database, on :attr:`dashboard_url`)."""

    def __init__(
        self, specs: list[EngineSpec], port: int, logs: Path, bootstrap: str, server_url: str
    ) -> None:
        """``server_url``: a PostgreSQL URL of a role that may create databases (the lab's
        own is made there and dropped on ``close``)."""
        self.specs, self.port, self.logs = specs, port, logs
        tag = uuid.uuid4().hex[:10]
        self.topic = f"kv-events-lab-{tag}"
        self.group = f"kvledger-lab-{tag}"
        self.database = f"kvledger_lab_{tag}"
        self.bootstrap = bootstrap
        self.admin_url = server_url
        self.database_url = ""
        self.relays: list[Process] = []
        self.consumer: Process | None = None
        self.server: Process | None = None
        self.republisher: Process | None = None
        self.dashboard: Process | None = None
        self.dashboard_port = port + 8
        # More `serve --memory` replicas (the routers' own, sharing decisions), on the
        # ports below the first's.
        self.replica_ports = [port - 10 + k for k in range(REPLICAS - 1)]
        self.replicas: list[Process] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def urls(self) -> list[str]:
        """Every replica of the lookup service, the first :attr:`url`."""
        return [self.url, *(f"http://127.0.0.1:{p}" for p in self.replica_ports)]

    def _cli(self, name: str, *args: str) -> Process:
        env = {
            "KVLEDGER_DATABASE_URL": self.database_url,
            "KVLEDGER_LOOKUP_DATABASE_URL": self.database_url,  # the lab's own database
            "KVLEDGER_KAFKA_BOOTSTRAP": self.bootstrap,
        }
        return Process(name, [sys.executable, "-m", "kvledger", *args], self.logs, env)

    def start(self) -> None:
        from kvledger.consumer.db import create_database

        require_free([self.port, self.dashboard_port], "kvledger serve")
        self.database_url = create_database(self.admin_url, self.database)
        migrate = self._cli("migrate", "migrate").start()
        assert migrate.proc is not None
        if migrate.proc.wait(timeout=120) != 0:
            raise LabError(f"kvledger migrate failed:\n{migrate.log_tail()}")
        for i, spec in enumerate(self.specs):
            self.relays.append(
                self._cli(
                    f"relay-{i}",
                    "relay",
                    "--endpoint",
                    spec.pub_endpoint,
                    "--replay-endpoint",
                    spec.replay_endpoint,
                    "--source",
                    source_name(i),
                    "--model",
                    MODEL,
                    "--group",
                    f"0:full_attention:{BLOCK_SIZE}",
                    "--topic",
                    self.topic,
                    "--heartbeat-interval",
                    "1",
                    # A restarting engine is live to routers once it serves, not before.
                    "--health-url",
                    f"{spec.url}/health",
                    # Each engine's requests running and queued, in its heartbeats.
                    "--engine-metrics-url",
                    f"{spec.url}/metrics",
                ).start()
            )
        self.consumer = self._cli(
            "consume",
            "consume",
            "--topic",
            self.topic,
            "--consumer-group",
            self.group,
            "--dlq-topic",
            f"{self.topic}.dlq",
            # The decision routers' records, for the dashboard's funnel and decision_funnel.
            "--decisions-topic",
            f"{self.topic}.decisions",
        ).start()
        self.server = self._server("serve", self.port)
        self.restart_server()
        for k, port in enumerate(self.replica_ports):
            require_free([port], "kvledger serve")
            replica = self._server(f"serve-{k + 1}", port)
            self.replicas.append(replica)
            replica.start().wait_http(f"http://127.0.0.1:{port}/healthz", timeout=90)
        sources = []
        for i, spec in enumerate(self.specs):
            pub, replay = spec.republished
            require_free([pub, replay], "kvledger republish")
            sources += ["--source", f"{source_name(i)}={pub}:{replay}"]
        self.republisher = self._cli(
            "republish", "republish", *sources, "--topic", self.topic,
            "--consumer-group", self.group, "--silent-after", str(SILENT_AFTER_S),
            "--metrics-port", str(self.port + 3),
        )  # fmt: skip
        self.republisher.start().wait_http(f"http://127.0.0.1:{self.port + 3}/metrics", 90)
        self.dashboard = self._cli(
            "dashboard", "serve", "--allow-writer", "--port", str(self.dashboard_port)
        )
        self.dashboard.start().wait_http(f"{self.dashboard_url}/healthz", timeout=90)

    def _server(self, name: str, port: int) -> Process:
        return self._cli(
            name, "serve", "--memory", "--dynamo-api", "--allow-writer", "--topic", self.topic,
            "--consumer-group", self.group, "--port", str(port), "--silent-after",
            str(SILENT_AFTER_S), "--decisions-topic", f"{self.topic}.decisions",
        )  # fmt: skip

    def restart_server(self) -> None:
        assert self.server is not None
        self.server.stop()
        self.server.start().wait_http(f"{self.url}/healthz", timeout=90)

    def restart_relay(self, engine: int, down_for: float) -> None:
        """Kill an engine's relay (no goodbye), leave it down ``down_for`` s, start it again."""
        self.relays[engine].kill()
        time.sleep(down_for)
        self.relays[engine].start()

    def processes(self) -> list[Process]:
        others = (self.consumer, self.server, self.republisher, self.dashboard)
        return [*self.relays, *(p for p in others if p is not None), *self.replicas]

    def check(self) -> None:
        """Every kvledger process still running, or an error with the first dead one's log."""
        for process in self.processes():
            if not process.alive():
                raise LabError(f"kvledger's {process.name} stopped:\n{process.log_tail()}")

    def funnel(self, since: float, until: float, wait_s: float = 20.0) -> dict[str, Any]:
        """kvledger's own account of the decisions taken between the Unix times ``since`` and
        ``until``, from the database the dashboard reads (kvledger.decision_outcomes):
        their count, the prompt, available, captured and delivered blocks, and each outcome's
        count. Waits (up to ``wait_s``) for the consumer to record the last of them."""
        from kvledger.consumer.db import connect

        window = "FROM kvledger.decision_outcomes WHERE decided_at >= to_timestamp(%s) " \
                 "AND decided_at < to_timestamp(%s)"  # fmt: skip
        totals = (
            "SELECT count(*), coalesce(sum(prompt_blocks), 0), "
            "coalesce(sum(available_blocks), 0), coalesce(sum(captured_blocks), 0), "
            f"sum(delivered_blocks), count(delivered_blocks) {window}"
        )
        deadline, last = time.monotonic() + wait_s, None
        with connect(self.database_url, autocommit=True) as conn:
            while True:
                row = conn.execute(totals, (since, until)).fetchone()
                assert row is not None
                if row == last or time.monotonic() > deadline:
                    break  # nothing more arrived in the last second
                last = row
                time.sleep(1.0)
            by_outcome = f"SELECT outcome, count(*) {window} GROUP BY outcome ORDER BY outcome"
            outcomes = conn.execute(by_outcome, (since, until)).fetchall()
        decisions, prompt, available, captured, delivered, known = row
        return {
            "decisions": decisions,
            "prompt_blocks": prompt,
            "available_blocks": available,
            "captured_blocks": captured,
            "captured_over_available": round(captured / available, 4) if available else 0.0,
            "delivered_blocks": delivered,
            "delivered_known": known,
            "outcomes": dict(outcomes),
        }

    def close(self) -> None:
        for process in self.processes():
            process.stop()
        if self.database_url:
            from kvledger.consumer.db import drop_database

            with contextlib.suppress(Exception):
                drop_database(self.admin_url, self.database)
        with contextlib.suppress(Exception):
            from confluent_kafka.admin import AdminClient

            admin = AdminClient({"bootstrap.servers": self.bootstrap})
            topics = [self.topic, f"{self.topic}.dlq", f"{self.topic}.decisions"]
            for future in admin.delete_topics(topics).values():
                with contextlib.suppress(Exception):
                    future.result(timeout=10)


def vllm_router(
    name: str, policy: str, specs: list[EngineSpec], port: int, logs: Path,
    republished: bool = False,
) -> Process:  # fmt: skip
    """vllm-router in front of the engines with one of its policies; ``kv_aware`` hears the
    engines' streams, or (``republished``) kvledger's republished ones."""
    binary = install.engine_env() / "bin" / "vllm-router"
    args = [
        str(binary),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--worker-urls",
        *(s.url for s in specs),
        "--log-level",
        "warning",
        # Its metrics on a port of its own (29000 unless told): replicas side by side.
        "--prometheus-port",
        str(port + 100),
    ]
    if policy == "kv_aware":
        for spec in specs:
            pub, replay = (
                (f"tcp://127.0.0.1:{p}" for p in spec.republished)
                if republished
                else (spec.pub_endpoint, spec.replay_endpoint)
            )
            args += [
                "--kv-event-source",
                f"{spec.url}={pub}",
                "--kv-event-replay-source",
                f"{spec.url}={replay}",
            ]
        args += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
    return Process(name, args, logs)


def dynamo_indexer(port: int, logs: Path) -> Process:
    """NVIDIA Dynamo's standalone indexer (ai-dynamo-runtime, the project's dev install)."""
    return Process(
        "dynamo-indexer",
        [
            sys.executable,
            "-m",
            "dynamo.indexer",
            "--port",
            str(port),
            "--block-size",
            str(BLOCK_SIZE),
            "--model-name",
            MODEL,
        ],
        logs,
    )


def register_workers(url: str, specs: list[EngineSpec]) -> None:
    """Dynamo's way: the indexer dials each engine's PUB endpoint itself."""
    for i, spec in enumerate(specs):
        post_json(
            f"{url}/register",
            {
                "instance_id": i,
                "endpoint": spec.pub_endpoint,
                "model_name": MODEL,
                "block_size": BLOCK_SIZE,
            },
        )


def from_environment(specs: list[EngineSpec], port: int, logs: Path) -> Kvledger:
    """kvledger on the services of ``scripts/services env`` (what ``make lab`` exports)."""
    server = os.environ.get("KVLEDGER_ADMIN_DATABASE_URL") or _need("KVLEDGER_DATABASE_URL")
    return Kvledger(specs, port, logs, _need("KVLEDGER_KAFKA_BOOTSTRAP"), server)


def _need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise LabError(f"the lab needs ${name} (make lab sets it from scripts/services)")
    return value
