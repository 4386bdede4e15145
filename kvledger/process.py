"""Process-wide settings for the long-running commands (serve, consume): both freeze what
start-up loaded and collect cyclic garbage in larger, rarer passes."""

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


# The young generation's size before a collection, for a server (generations 1 and 2 are
# collected every 20 and 10 of the one before). Every connection a flood opens and drops
# leaves reference cycles (its protocol, transport and parser): at Python's default of 700
# the collections they set off paused answers often enough to show in the p99 (5.2x quiet
# under bench/http_attack.py's slowloris; 1.5x at this size, the RSS growth unchanged).
# The consumer's batches allocate ~100,000 objects each, nearly all freed with the batch:
# at 700 they set off collections that walked them while alive (apply 39.1k and 37.0k
# block events/s, against 45.7k and 42.9k at this size, side by side in one run).
SERVER_COLLECTION = (50_000, 20, 10)


def collect_less_often() -> None:
    """Collect cyclic garbage in larger, rarer passes (see above)."""
    gc.set_threshold(*SERVER_COLLECTION)
