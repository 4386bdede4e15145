"""``python -m kvledger``: the same command as ``kvledger``."""

from __future__ import annotations

import sys

from kvledger.cli import main

if __name__ == "__main__":
    sys.exit(main())
