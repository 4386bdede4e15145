"""`python -m tests.fuzz [--seconds N] [TARGET ...]`: each fuzz target (tests/fuzz/targets.py)
under atheris, coverage-guided from its seed corpus (tests/fuzz/corpus/TARGET), for its share
of N seconds (default 120 in all), each in its own process. A target that fails keeps the
input that made it fail under fuzz-crashes/ and the run exits 1."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
# targets.TARGETS' names (importing it here would instrument every import of this process)
NAMES = ("envelope", "batch", "sglang", "trtllm", "dynamo", "group", "decisions", "replay")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--seconds", type=float, default=120.0, help="in all (default 120)")
    parser.add_argument("targets", nargs="*", help="default: every target")
    args = parser.parse_args()
    names = args.targets or list(NAMES)
    share = max(1, int(args.seconds / len(names)))
    crashes = ROOT / "fuzz-crashes"
    failed = []
    for name in names:
        seeds = HERE / "corpus" / name
        with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-") as work:
            crashes.mkdir(exist_ok=True)
            cmd = [
                sys.executable, "-m", "tests.fuzz.run", name, f"-max_total_time={share}",
                f"-artifact_prefix={crashes}/{name}-", "-rss_limit_mb=4096", work, str(seeds),
            ]  # fmt: skip
            print(f"fuzz {name}: {share} s from {len(list(seeds.iterdir()))} seeds", flush=True)
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
            tail = [line for line in done.stderr.splitlines() if line.startswith("Done ")][-1:]
            print(f"fuzz {name}: exit {done.returncode} {' '.join(tail)}", flush=True)
            if done.returncode != 0:
                failed.append(name)
                print(done.stderr[-4000:], file=sys.stderr)
    if not failed and crashes.exists() and not any(crashes.iterdir()):
        crashes.rmdir()
    print(f"fuzz: {len(names) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
