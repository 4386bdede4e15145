"""`kvledger demo`: the whole system on a simulated fleet, with a report a person can read.

simulate (several engines, shared system prompts, GPU + CPU + STORAGE tiers, evictions,
partial tails, a sliding-window group, one misconfigured source, one engine that crashes
and restarts mid-run) → tracker → publisher → Kafka → consumer → PostgreSQL index → what
the restart dropped, a routing decision and audit answers in SQL. One engine is a stock one:
it speaks vLLM's ZMQ KV-event protocol (GPU block-pool events and CPU offloads, no kvledger
code in it) and reaches Kafka through ``kvledger relay``, with one batch kept from its live
stream that the relay gets back by replay.

The demo works in its own database (``<database>_demo``), topic (``kv-events-demo``) and
consumer group, recreated on every run, so a second run starts clean; ``--name`` gives
them another name (the tests run it under names of their own).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import threading
import time
from collections.abc import Sequence

import sqlalchemy as sa
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kvledger import demo_report as report
from kvledger import settings
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect, create_database, migrate
from kvledger.consumer.service import IndexConsumer
from kvledger.fleet import (
    FULL_GROUP,
    SLIDING_GROUP,
    FleetConfig,
    instance_ids,
)
from kvledger.producer.relay.config import RelayConfig
from kvledger.producer.relay.relay import Relay
from kvledger.producer.tracker import group_announcement
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import ensure_topic
from kvledger.simulate_cmd import run_simulation
from kvledger.vllm_engine import VllmWireSink, ZmqEngine

NAME = re.compile(r"^[a-z][a-z0-9_]{0,30}$")  # a database suffix, a topic's and a group's
HIDDEN_BATCH = 40  # the relayed engine's batch kept from its live stream (a forced gap)


def _demo_database(server_url: str, name: str) -> str:
    database = f"{sa.engine.make_url(server_url).database or 'kvledger'}_{name}"
    return create_database(server_url, database, replace=True)


def _fresh_topics(admin: AdminClient, names: Sequence[str]) -> None:
    existing = set(admin.list_topics(timeout=10).topics)
    doomed = [n for n in names if n in existing]
    if doomed:
        for future in admin.delete_topics(doomed).values():
            with contextlib.suppress(KafkaException):
                future.result(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and set(doomed) & set(
            admin.list_topics(timeout=10).topics
        ):
            time.sleep(0.2)


def run(args: argparse.Namespace) -> int:  # noqa: C901, PLR0915 - the demo's script, step by step
    if not args.verbose:  # the report is the output: only warnings of what went wrong beside it
        logging.getLogger("kvledger").setLevel(logging.WARNING)
        # Placeholders are what a simulated engine's sliding-window group announces, and a
        # broker just started has librdkafka retry and say so: neither is the reader's
        # concern here (-v shows them).
        logging.getLogger("kvledger.producer.tracker").setLevel(logging.ERROR)
        logging.getLogger("kvledger.kafka").setLevel(logging.ERROR)
    bootstrap = settings.kafka_bootstrap(args)
    server = settings.database_url(args.database_url)
    if args.instances < 2:
        raise SystemExit("kvledger demo: --instances must be at least 2")
    if not NAME.match(args.name):
        raise SystemExit(f"kvledger demo: --name {args.name!r}: a-z, 0-9 and _, a letter first")
    # Its own topic, group and database: kv-events-<name>, kvledger-<name>, <db>_<name>.
    topic, group = f"kv-events-{args.name}", f"kvledger-{args.name}"
    fleet = FleetConfig(
        instances=args.instances,
        requests=args.requests,
        seed=args.seed,
        misconfigured_source=True,
        gpu_capacity_blocks=256,
        restart=(report.RESTARTED, args.requests // 2),
    )
    print("kvledger demo: a simulated fleet → Kafka → consumer → PostgreSQL prefix-cache index")
    print(
        f"   broker {bootstrap}; {fleet.instances} engines + 1 misconfigured, "
        f"{fleet.requests} requests each, seed {fleet.seed}; {report.RESTARTED} crashes and "
        f"restarts after {fleet.requests // 2}"
    )

    report.section("set-up")
    database = _demo_database(server, args.name)
    migrate(database)
    print(f"   database {sa.engine.make_url(database).database} created and migrated")
    admin = AdminClient(client_logging({"bootstrap.servers": bootstrap, "log_level": 4}))
    _fresh_topics(admin, [topic, f"{topic}.dlq"])
    ensure_topic(admin, topic, 12)
    print(f"   topic {topic} (12 partitions) and dead-letter topic {topic}.dlq")

    consumer = IndexConsumer(
        ConsumerConfig(
            bootstrap_servers=bootstrap,
            database_url=database,
            topic=topic,
            group_id=group,
            dlq_topic=f"{topic}.dlq",
            batch_size=2000,
            batch_timeout_s=0.2,
        )
    )
    consumer_thread = threading.Thread(target=consumer.run, name="consumer", daemon=True)
    consumer_thread.start()
    print(f"   consumer started (group {group})")
    relayed = instance_ids(fleet)[fleet.instances - 1]  # the last engine is a stock one
    engine = ZmqEngine(0, 0)
    wire = VllmWireSink(engine, hide=lambda seq: seq == HIDDEN_BATCH)
    relay = Relay(
        RelayConfig(
            endpoint=engine.endpoint,
            replay_endpoint=engine.replay_endpoint,
            source=relayed,
            model=fleet.model,
            bootstrap_servers=bootstrap,
            topic=topic,
            groups=[group_announcement(fleet.model, g) for g in (FULL_GROUP, SLIDING_GROUP)],
        )
    )
    relay.start()
    if not relay.ready(60):
        print("kvledger demo: the relay did not start", file=sys.stderr)
        return 1
    time.sleep(0.5)  # the relay's subscription reaches the engine before it publishes
    print(
        f"   {relayed}: a stock engine on {engine.endpoint} (replay {engine.replay_endpoint}),"
        f" relayed by `kvledger relay`"
    )

    report.section("publishing")
    sim = run_simulation(bootstrap, topic, fleet, partitions=12, sinks={relayed: wire})
    all_relayed = _finish_relay(relay, engine)
    s = sim.summary
    print(
        f"   {s.requests} requests: {s.lookup_hits} chunk lookup hits, {s.promotions} "
        f"promotions from STORAGE, {s.partial_tails} partial tails stored"
    )
    print(
        f"   {sim.produced} messages produced, {sim.acked} acknowledged "
        f"({', '.join(f'{k} {v}' for k, v in sorted(sim.by_type.items()))})"
    )

    report.section("consuming")
    start = time.monotonic()
    lag = -1
    while time.monotonic() - start < 300:
        lag = consumer.lag()
        if sys.stderr.isatty():
            sys.stderr.write(
                f"\r   lag {lag:>8,} messages; applied {consumer.summary.applied:,}   "
            )
            sys.stderr.flush()
        if lag == 0 and consumer.summary.messages >= sim.produced:
            break
        time.sleep(0.3)
    consumer.stop()
    consumer_thread.join(timeout=60)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    c = consumer.summary
    print(f"   consumer lag reached {lag} after {time.monotonic() - start:.1f} s")
    print(
        f"   {c.messages} messages: {c.applied} applied, {c.rejected} rejected, "
        f"{c.duplicates} duplicate; {c.block_events} block events"
    )
    with connect(database, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE event_type = 'GroupSpec'), "
            "count(*) FILTER (WHERE event_type = 'Heartbeat') "
            "FROM kvledger.events WHERE source = %s",
            (relayed,),
        ).fetchone()
    from_relay, announced, beats = row if row is not None else (0, 0, 0)
    print(
        f"   = {sim.produced} the simulated engines' publishers produced + {from_relay} from "
        f"the relay ({from_relay - announced - beats} of {relayed}'s events, {announced} group "
        f"announcements and {beats} heartbeat(s) it makes itself)"
    )
    for reason, count in sorted(c.rejected_by_reason.items()):
        print(f"   rejected {reason}: {count} (kept with raw bytes; also in {topic}.dlq)")
    if lag != 0:
        print("kvledger demo: the consumer did not catch up", file=sys.stderr)
        return 1

    with connect(database, autocommit=True) as conn:
        report.sql(
            conn,
            "per-instance footprint by tier (view kvledger.instance_footprint)",
            """
SELECT instance, medium, ownership, blocks, refs, tokens
FROM kvledger.instance_footprint
WHERE group_idx = 0 ORDER BY instance, medium, ownership
""",
        )
        report.misconfigured(conn)
        report.sql(
            conn,
            "top shared prefixes (view kvledger.hottest_prefixes)",
            """
SELECT encode(block_hash, 'hex') AS block_hash, token_start, token_end, instances
FROM kvledger.hottest_prefixes
WHERE group_idx = 0
ORDER BY instances DESC, token_end DESC LIMIT 5
""",
        )
        report.restarted(conn)
        report.relayed(conn, relay, engine, wire, all_relayed)
        report.routing(conn, fleet)
        report.audits(conn)
    report.section("explore")
    url = sa.engine.make_url(database)
    if args.keep:
        print("   the services are left running (scripts/services down stops them); in a shell:")
    else:
        print("   `make demo` stops the services it started: `make demo KEEP=1` keeps them; then:")
    # No password on the screen: it is the one in $KVLEDGER_DATABASE_URL (scripts/services env).
    demo_url = f'"${{KVLEDGER_DATABASE_URL%/*}}/{url.database}"'
    print('   eval "$(scripts/services env)"')
    for command in ("sources", "dlq list", "groups list"):
        print(f"   .venv/bin/kvledger {command} --database-url {demo_url}")
    print(f'   psql "${{KVLEDGER_PSQL_URL%/*}}/{url.database}"   (the index in SQL: docs/sql.md)')
    print(f"   .venv/bin/kvledger serve --allow-writer --database-url {demo_url}")
    print("     then http://127.0.0.1:8080/ui: the dashboard (its token: none, on 127.0.0.1)")
    print("   README.md's First steps: a fleet of your own, and a lookup of its prompts")
    return 0


def _finish_relay(relay: Relay, engine: ZmqEngine, timeout: float = 60) -> bool:
    """Wait until the relay has committed the engine's last batch, then stop both."""
    deadline = time.monotonic() + timeout
    rank = relay.ranks[0]
    while rank.committed_seq != engine.seq - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    done = rank.committed_seq == engine.seq - 1
    relay.stop()
    engine.close()
    return done
