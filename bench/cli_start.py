"""How long `kvledger --help` and `kvledger COMMAND --help` take to start, beside
`python -c pass` (the interpreter's own start) in the same run: best of 10 each."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import record

COMMANDS = {
    "python_pass": [sys.executable, "-c", "pass"],
    "help": [sys.executable, "-m", "kvledger", "--help"],
    "serve_help": [sys.executable, "-m", "kvledger", "serve", "--help"],
    "consume_help": [sys.executable, "-m", "kvledger", "consume", "--help"],
}


def _best(argv: list[str], rounds: int = 10) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    seconds = {name: _best(argv) for name, argv in COMMANDS.items()}
    figures: dict[str, float] = {f"{name}_s": s for name, s in seconds.items()}
    for name in ("help", "serve_help", "consume_help"):
        figures[f"{name}_minus_python_s"] = seconds[name] - seconds["python_pass"]
    record("cli_start", figures)


if __name__ == "__main__":
    main()
