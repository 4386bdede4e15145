"""A newcomer's way from the README to a dashboard with data, timed on a warm machine.

The README's steps, as a newcomer types them: `make demo KEEP=1` (the main job, leaving the
services up), then the `kvledger serve` line the demo prints at its close, then the
dashboard: its page (`/ui`) and the data it asks for (`/v1/dashboard`), which must name the
demo's fleet and its occupancy. The figure is the seconds from the first command to that
answer, beside the target (300 s) and beside the demo alone. Warm: the virtualenv is built
and the services' downloads are cached (a first `make venv` has run); the services may be up.

Run with ``python -m bench.first_dashboard`` from the clone's root; it writes
bench/results/first-dashboard/<date>.{json,md}. It stops what it started afterwards.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import PUBLISHED, publish, record

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 300.0
_SERVE_LINE = re.compile(r"^\s*(\.venv/bin/kvledger serve .*)$", re.MULTILINE)


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return int(answer.status), answer.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _own_services(state: str) -> dict[str, str]:
    """A newcomer's shell, with services of the run's own: a state folder and free ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    env["KVLEDGER_STATE_DIR"] = state
    for name in ("KAFKA_PORT", "KAFKA_CONTROLLER_PORT", "PG_PORT", "PG_STANDBY_PORT"):
        env[f"KVLEDGER_{name}"] = str(_free_port())
    return env


def main() -> dict[str, float | str]:
    with tempfile.TemporaryDirectory(prefix="kvledger-first-") as state:
        env = _own_services(state)
        try:
            return _timed(env, _free_port())
        finally:
            subprocess.run(["scripts/services", "down"], cwd=ROOT, env=env, check=False,
                           capture_output=True)  # fmt: skip


def _timed(env: dict[str, str], port: int) -> dict[str, float | str]:
    started = time.monotonic()
    demo = subprocess.run(
        ["make", "--no-print-directory", "demo", "KEEP=1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    demo_s = time.monotonic() - started
    if demo.returncode != 0:
        raise SystemExit(f"make demo KEEP=1 failed:\n{demo.stdout[-3000:]}{demo.stderr[-3000:]}")
    found = _SERVE_LINE.search(demo.stdout)
    if found is None:
        raise SystemExit("the demo's close printed no `kvledger serve` line")
    command = f'eval "$(scripts/services env)"; exec {found.group(1)} --port {port}'
    serve = subprocess.Popen(
        ["bash", "-c", command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                page_status, page = _get(f"{base}/ui")
                break
            except OSError:
                if serve.poll() is not None or time.monotonic() > deadline:
                    said = serve.stderr.read()[-2000:] if serve.stderr else ""
                    raise SystemExit(f"serve did not answer: {said}") from None
                time.sleep(0.1)
        status, body = _get(f"{base}/v1/dashboard?minutes=60")
        data = json.loads(body)
        shown_s = time.monotonic() - started
    finally:
        serve.terminate()
        serve.wait(30)
    assert page_status == 200 and b"<html" in page.lower(), page[:200]
    fleet, occupancy = data.get("fleet", []), data.get("occupancy", [])
    if status != 200 or not fleet or not occupancy:
        raise SystemExit(f"the dashboard had no data: {status} {body[:500]!r}")
    figures: dict[str, float | str] = {
        "README to a dashboard with data, s": shown_s,
        "target, s": TARGET_S,
        "of it the demo (make demo KEEP=1), s": demo_s,
        "dashboard: instances / occupancy points": f"{len(fleet)} / {len(occupancy)}",
    }
    record("first-dashboard", figures)
    return figures


if __name__ == "__main__":
    figures = main()
    written = publish(
        {"first-dashboard": figures},
        PUBLISHED / "first-dashboard",
        command="python -m bench.first_dashboard",
    )
    print(f"wrote {', '.join(str(w) for w in written)}", file=sys.stderr)
