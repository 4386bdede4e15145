"""One fuzz target under atheris: `python -m tests.fuzz.run TARGET [libFuzzer options] DIRS`."""

from __future__ import annotations

import sys

import atheris


def main() -> None:
    name = sys.argv.pop(1)
    from tests.fuzz.targets import TARGETS

    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
