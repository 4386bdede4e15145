"""Process-wide settings for the long-running commands (serve, consume)."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Keep what start-up loaded (modules, the app, clients) out of the collector's scans.

    Those objects live as long as the process; left in the oldest generation, every full
    collection walks them again (~20 ms for `kvledger serve`, paid inside whichever request
    or batch triggered it).
    """
    gc.collect()
    gc.freeze()
