"""A real Prometheus server for the tests (Debian's package: prometheus and promtool)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.procs import free_port, spawn


def ensure_prometheus() -> tuple[str, str]:
    """Paths of ``prometheus`` and ``promtool``, installed from Debian's packages when
    missing and we are root (as CI is); raises RuntimeError otherwise."""
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        if os.geteuid() != 0:
            raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
        if subprocess.run(install, env=env, capture_output=True, check=False).returncode:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, check=True)
            subprocess.run(install, env=env, capture_output=True, check=True)
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prometheus and promtool):
        raise RuntimeError("apt-get installed prometheus but its commands are not on PATH")
    return prometheus, promtool


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, promql: str) -> list[dict[str, object]]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        result: list[dict[str, object]] = body["data"]["result"]
        return result

    def value(self, promql: str) -> float | None:
        """The query's single value, or None while it has no result."""
        result = self.query(promql)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])  # type: ignore[index]

    def wait_for(self, promql: str, expected: float, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            seen = self.value(promql)
            if seen == expected:
                return
            time.sleep(0.5)
        raise AssertionError(f"{promql} = {seen}, expected {expected}")


@contextmanager
def prometheus_server(targets: dict[str, str], folder: Path) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (job → host:port) every second, on a free loopback
    port, with its data in ``folder``; stopped afterwards."""
    binary, _ = ensure_prometheus()
    folder.mkdir(parents=True, exist_ok=True)
    jobs = "\n".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']"
        for job, target in targets.items()
    )
    config = folder / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n{jobs}\n")
    port = free_port()
    proc = spawn(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(folder / "prometheus.log").open("w"),
    )  # fmt: skip
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                server.query("up")
                break
            except OSError:
                assert proc.poll() is None, (folder / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "prometheus did not start"
                time.sleep(0.3)
        yield server
    finally:
        proc.terminate()
        proc.wait(30)
