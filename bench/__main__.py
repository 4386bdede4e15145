"""`make bench`: every benchmark, each figure beside its baseline from the same run.

Writes bench/results.json and prints a short table. Needs the services
(KVLEDGER_KAFKA_BOOTSTRAP, KVLEDGER_DATABASE_URL), which `make bench` starts.
"""

from __future__ import annotations

import json
import logging

from bench import consume, lookup, previous, produce, relay, router, scale, tracker_encode
from bench.common import RESULTS


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    if RESULTS.exists():
        RESULTS.unlink()
    # Read-only lookups first: the consumer benchmarks leave dead rows for autovacuum.
    tracker_encode.main()
    lookup.main()
    router.main()  # on the lookup benchmark's index, beside SQL
    produce.main()
    relay.main()
    consume.main()
    previous.main()  # the apply rate beside the release before the core split
    scale.main()  # 1, 2 and 3 consumers in one group, side by side
    data = json.loads(RESULTS.read_text())
    print(f"\nwrote {RESULTS}")
    print(f"{'benchmark':<16} {'figure':<58} {'value':>14}")
    for name, figures in data.items():
        for key, value in figures.items():
            print(f"{name:<16} {key:<58} {value:>14,.2f}")


if __name__ == "__main__":
    main()
