"""`make bench`: every benchmark, each figure beside its baseline from the same run.

Collects the figures in bench/results.json while it runs, then writes the run's dated
results, bench/results/<date>.json and .md (a Markdown table): the one place the figures
are stated. Needs the services
(KVLEDGER_KAFKA_BOOTSTRAP, KVLEDGER_DATABASE_URL), which `make bench` starts.
"""

from __future__ import annotations

import json
import logging

from bench import (
    cli_start,
    consume,
    dashboard,
    decisions,
    dynamo_api,
    flood,
    freshness,
    http_attack,
    lookup,
    peers,
    previous,
    produce,
    relay,
    republish,
    retention,
    router,
    scale,
    tracker_encode,
)
from bench.common import RESULTS, publish


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    if RESULTS.exists():
        RESULTS.unlink()
    # Read-only lookups first: the consumer benchmarks leave dead rows for autovacuum.
    tracker_encode.main()
    flood.main()  # no services: crafted block hashes beside random ones
    cli_start.main()  # no services: the command's start-up beside Python's
    http_attack.main()  # no services: serve under slowloris beside uvicorn's own protocol
    lookup.main()
    router.main()  # on the lookup benchmark's index, beside SQL
    peers.main()  # the same index as events, into kvledger's core and Dynamo's RadixTree
    dynamo_api.main()  # Dynamo's POST /query from kvledger beside Dynamo's own indexer
    decisions.main()  # no services: POST /v1/decisions beside the lookup before it
    produce.main()
    relay.main()
    freshness.main()  # an engine's batch to each reader, beside a raw ZMQ subscriber
    republish.main()  # a restarted subscriber's whole view from `kvledger republish`
    consume.main()
    dashboard.main()  # the dashboard's data on a large index; the apply rate beside it
    previous.main()  # the apply rate beside the release before the core split
    scale.main()  # 1, 2 and 3 consumers in one group, side by side
    retention.main()  # 10 minutes: the schema's size with retention beside without
    data = json.loads(RESULTS.read_text())
    written = publish(data)
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    print(f"{'benchmark':<16} {'figure':<58} {'value':>14}")
    for name, figures in data.items():
        for key, value in figures.items():
            shown = f"{value:>14,.2f}" if isinstance(value, int | float) else f"{value!s:>14}"
            print(f"{name:<16} {key:<58} {shown}")


if __name__ == "__main__":
    main()
