"""The lab's child processes: each in its own process group with its own log file, so that
stopping one stops what it spawned, and every failure says which process and shows the tail
of its log. Engines (bench/lab/engines.py), kvledger's commands, vllm-router and Dynamo's
indexer (bench/lab/stack.py) all run as a :class:`Process`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class LabError(RuntimeError):
    """A process the lab runs failed to start, died or answered wrongly; the message names
    it and has the tail of its log."""


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
        raise LabError(
            f"{what}: port(s) {', '.join(map(str, taken))} already in use; "
            "stop what holds them or choose other ports (--base-port)"
        )


class Process:
    """A child process with a name, a log file per start and its own process group."""

    def __init__(
        self, name: str, args: list[str], logs: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.args, self.logs = name, args, logs
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.name}.{self.starts}.log"

    def start(self) -> Process:
        """Start it (returns at once; ``wait_http`` waits for it to answer)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: signal.Signals = signal.SIGTERM, grace: float = 15.0) -> None:
        """``sig`` to the process's group (even when its leader has gone: what it spawned
        goes too), SIGKILL after ``grace`` seconds."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)

    def kill(self) -> None:
        """SIGKILL to the group: a crash, no goodbye."""
        self.stop(signal.SIGKILL)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:])

    def wait_http(self, url: str, timeout: float) -> float:
        """Seconds until ``url`` answered 200. The process ending, or the timeout (after
        which it is killed), raise :class:`LabError` with its log's tail."""
        began = time.monotonic()
        while True:
            if not self.alive():
                code = None if self.proc is None else self.proc.returncode
                raise LabError(f"{self.name} exited ({code}) while starting:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(url, timeout=2) as answer,
            ):
                if answer.status == 200:
                    return time.monotonic() - began
            if time.monotonic() - began > timeout:
                self.kill()
                raise LabError(
                    f"{self.name} did not answer {url} in {timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.3)
