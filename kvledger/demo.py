"""`kvledger demo`: the whole system on a simulated fleet, with a report a person can read.

simulate (several engines, shared system prompts, GPU + CPU + STORAGE tiers, evictions,
partial tails, a sliding-window group, one misconfigured source, one engine that crashes
and restarts mid-run) → tracker → publisher → Kafka → consumer → PostgreSQL index → what
the restart dropped, a routing decision and audit answers in SQL. One engine is a stock one:
it speaks vLLM's ZMQ KV-event protocol (GPU block-pool events and CPU offloads, no kvledger
code in it) and reaches Kafka through ``kvledger relay``, with one batch kept from its live
stream that the relay gets back by replay.

The demo works in its own database (``<database>_demo``) and its own topic
(``kv-events-demo``), both recreated on every run, so a second run starts clean.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg
import sqlalchemy as sa
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kvledger import settings
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.db import connect, create_database, migrate
from kvledger.consumer.lookup import PrefixIndex, rank
from kvledger.consumer.service import IndexConsumer
from kvledger.fleet import (
    FULL_GROUP,
    SLIDING_GROUP,
    FleetConfig,
    instance_ids,
    prompt_hashes,
    random_tokens,
    system_prompts,
)
from kvledger.producer.relay.config import RelayConfig
from kvledger.producer.relay.relay import Relay
from kvledger.producer.tracker import group_announcement
from kvledger.schemas.topics import ensure_topic
from kvledger.simulate_cmd import run_simulation
from kvledger.tables import print_table
from kvledger.vllm_engine import VllmWireSink, ZmqEngine

TOPIC = "kv-events-demo"
GROUP = "kvledger-demo"
RESTARTED = "engine-0"
HIDDEN_BATCH = 40  # the relayed engine's batch kept from its live stream (a forced gap)
# The simulated engines stop publishing when the simulation ends; the demo's lookups count
# them as live for this long (the default window is 30 s).
DEMO_WINDOW = timedelta(minutes=10)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("demo", help="run the whole pipeline on a simulated fleet")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (else $KVLEDGER_KAFKA_BOOTSTRAP)")
    p.add_argument("--database-url", help="server to use (else $KVLEDGER_DATABASE_URL)")
    p.add_argument("--instances", type=int, default=4, help="simulated engines (at least 2)")
    p.add_argument("--requests", type=int, default=150, help="requests per instance")
    p.add_argument("--seed", type=int, default=7, help="the simulation's random seed")
    p.add_argument("--keep", action="store_true", help="leave the services up afterwards")
    p.set_defaults(run=_run)


def _section(title: str) -> None:
    print(f"\n== {title}")


def _sql(conn: psycopg.Connection, title: str, query: str, params: Sequence[object] = ()) -> None:
    _section(title)
    print("   " + "\n   ".join(line for line in query.strip().splitlines()))
    cur = conn.execute(query, params)
    header = [d.name for d in cur.description or []]
    print_table(header, cur.fetchall(), indent="   ")


def _demo_database(server_url: str) -> str:
    name = f"{sa.engine.make_url(server_url).database or 'kvledger'}_demo"
    return create_database(server_url, name, replace=True)


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


def _run(args: argparse.Namespace) -> int:
    bootstrap = settings.kafka_bootstrap(args)
    server = settings.database_url(args.database_url)
    if args.instances < 2:
        raise SystemExit("kvledger demo: --instances must be at least 2")
    fleet = FleetConfig(
        instances=args.instances,
        requests=args.requests,
        seed=args.seed,
        misconfigured_source=True,
        gpu_capacity_blocks=256,
        restart=(RESTARTED, args.requests // 2),
    )
    print("kvledger demo: a simulated fleet → Kafka → consumer → PostgreSQL prefix-cache index")
    print(
        f"   broker {bootstrap}; {fleet.instances} engines + 1 misconfigured, "
        f"{fleet.requests} requests each, seed {fleet.seed}; {RESTARTED} crashes and "
        f"restarts after {fleet.requests // 2}"
    )

    _section("set-up")
    database = _demo_database(server)
    migrate(database)
    print(f"   database {sa.engine.make_url(database).database} created and migrated")
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    _fresh_topics(admin, [TOPIC, f"{TOPIC}.dlq"])
    ensure_topic(admin, TOPIC, 12)
    print(f"   topic {TOPIC} (12 partitions) and dead-letter topic {TOPIC}.dlq")

    consumer = IndexConsumer(
        ConsumerConfig(
            bootstrap_servers=bootstrap,
            database_url=database,
            topic=TOPIC,
            group_id=GROUP,
            dlq_topic=f"{TOPIC}.dlq",
            batch_size=2000,
            batch_timeout_s=0.2,
        )
    )
    consumer_thread = threading.Thread(target=consumer.run, name="consumer", daemon=True)
    consumer_thread.start()
    print("   consumer started (group kvledger-demo)")
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
            topic=TOPIC,
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

    _section("publishing")
    sim = run_simulation(bootstrap, TOPIC, fleet, partitions=12, sinks={relayed: wire})
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

    _section("consuming")
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
    for reason, count in sorted(c.rejected_by_reason.items()):
        print(f"   rejected {reason}: {count} (kept with raw bytes; also in {TOPIC}.dlq)")
    if lag != 0:
        print("kvledger demo: the consumer did not catch up", file=sys.stderr)
        return 1

    with connect(database, autocommit=True) as conn:
        _sql(
            conn,
            "per-instance footprint by tier (view kvledger.instance_footprint)",
            """
SELECT instance, medium, ownership, blocks, refs, tokens
FROM kvledger.instance_footprint
WHERE group_idx = 0 ORDER BY instance, medium, ownership
""",
        )
        _sql(
            conn,
            "top shared prefixes (view kvledger.hottest_prefixes)",
            """
SELECT encode(block_hash, 'hex') AS block_hash, token_start, token_end, instances
FROM kvledger.hottest_prefixes
WHERE group_idx = 0
ORDER BY instances DESC, token_end DESC LIMIT 5
""",
        )
        _restart(conn)
        _relayed(conn, relayed, relay, engine, wire, all_relayed)
        _routing(conn, fleet)
        _audits(conn)
    _section("explore")
    url = sa.engine.make_url(database)
    # No password on the screen: it is the one in $KVLEDGER_DATABASE_URL (scripts/services env).
    print(
        f"   psql -h {url.host} -p {url.port} -U {url.username} {url.database}   "
        "(its password: the one in $KVLEDGER_DATABASE_URL)"
    )
    print(
        f"   kvledger sources / dlq list / groups list  (--database-url: that URL with the "
        f"database {url.database})"
    )
    if args.keep:
        print("   services left running; stop them with: scripts/services down")
    else:
        print("   (make demo KEEP=1 leaves the services running to explore this)")
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


def _relayed(
    conn: psycopg.Connection, source: str, relay: Relay, engine: ZmqEngine, wire: VllmWireSink,
    done: bool,
) -> None:  # fmt: skip
    m = relay.metrics

    def count(metric: Any) -> int:
        return int(metric.labels(source)._value.get())

    _section(f"{source}: a stock vLLM engine through `kvledger relay`")
    print(
        f"   the engine published {engine.seq} batches on ZMQ (GPU block-pool events and CPU "
        f"offloads, vLLM's shapes);\n   batch {', '.join(map(str, wire.hidden))} was kept "
        f"from the live stream (only the replay buffer had it)"
    )
    print(
        f"   relay: {count(m.batches_received)} batches received, "
        f"{count(m.events_relayed)} messages relayed, {count(m.gaps)} gap(s) seen, "
        f"{count(m.replays)} replay request(s), {count(m.unrecoverable)} unrecoverable "
        f"({count(m.lost_batches)} batches lost); all committed: {'yes' if done else 'NO'}"
    )
    _sql(
        conn,
        f"{source}'s blocks by tier (from its relayed events)",
        """
SELECT r.medium, count(*) AS blocks, sum(r.refcount) AS refs
FROM kvledger.residencies r WHERE r.instance = %(source)s
GROUP BY r.medium ORDER BY r.medium
""",
        {"source": source},  # type: ignore[arg-type]
    )
    row = conn.execute(
        "SELECT count(*) FROM kvledger.events WHERE source = %s AND status = 'applied'",
        (source,),
    ).fetchone()
    print(f"   {row[0] if row else 0} of its messages applied; nothing recorded lost")


def _routing(conn: psycopg.Connection, fleet: FleetConfig) -> None:
    import random

    prompts = system_prompts(fleet)
    prompt = prompts[0] + random_tokens(random.Random("router"), 300)
    hashes = prompt_hashes(prompt, fleet)
    index = PrefixIndex(conn)
    holders = index.match(fleet.model, FULL_GROUP.group_idx, hashes, silent_after=DEMO_WINDOW)
    _section("one routing decision")
    print(
        f"   prompt: system prompt 0 ({len(prompts[0])} tokens) + a new 300-token question = "
        f"{len(prompt)} tokens, {len(hashes)} blocks of {FULL_GROUP.tokens_per_block}"
    )
    print("   SELECT * FROM kvledger.match_prefix('sim-llama-8b', 0, <block hashes>)")
    print_table(
        ["instance", "medium", "ownership", "matched_blocks", "matched_tokens"],
        [
            (h.instance, h.medium, h.ownership or "-", h.matched_blocks, h.matched_tokens)
            for h in holders
        ],
        indent="   ",
    )
    ranked = rank(holders)
    print("   ranked with tier weights GPU 1.0, CPU 0.8, STORAGE 0.5:")
    for i, r in enumerate(ranked, 1):
        tiers = ", ".join(f"{m} {t} tokens" for m, t in sorted(r.tokens_by_tier.items()))
        print(f"   {i}. {r.instance}  score {r.score:,.0f}  ({tiers})")
    if ranked:
        best = ranked[0]
        print(
            f"   → route to {best.instance}: it already holds "
            f"{max(best.tokens_by_tier.values())} of the prompt's {len(prompt)} tokens"
        )
    else:
        print("   → no instance holds this prefix: route by load")


def _restart(conn: psycopg.Connection) -> None:
    _sql(
        conn,
        f"{RESTARTED} crashed and restarted: what the index dropped (view kvledger.restarts)",
        """
SELECT source, previous_epoch, epoch, restarted_at, ended_gpu, ended_cpu, ended_storage
FROM kvledger.restarts
""",
    )
    _sql(
        conn,
        f"{RESTARTED}'s blocks now, by tier and by incarnation",
        """
SELECT r.medium, count(*) FILTER (WHERE r.since < x.restarted_at) AS from_before_restart,
       count(*) FILTER (WHERE r.since >= x.restarted_at) AS since_restart
FROM kvledger.residencies r
JOIN kvledger.restarts x ON x.source = r.instance
WHERE r.instance = %(source)s
GROUP BY r.medium ORDER BY r.medium
""",
        {"source": RESTARTED},  # type: ignore[arg-type]
    )
    print(
        "   GPU and CPU blocks of the old process ended with reason 'restart' in the history;"
        "\n   its STORAGE blocks stayed (storage outlives a process unless the engine says not)."
    )


def _audits(conn: psycopg.Connection) -> None:
    row = conn.execute(
        "SELECT min(stored_at), max(coalesce(removed_at, stored_at)) "
        "FROM kvledger.residency_history"
    ).fetchone()
    assert row is not None
    first, last = row
    middle = first + (last - first) / 2 if first and last else None
    _sql(
        conn,
        "audit: what did engine-1 hold on CPU in the middle of the run, and why did it leave?",
        """
SELECT count(*) AS blocks_held,
       count(*) FILTER (WHERE removed_by = 'removed') AS evicted_later,
       count(*) FILTER (WHERE removed_at IS NULL) AS still_held
FROM kvledger.residency_history
WHERE instance = 'engine-1' AND medium = 'CPU' AND ownership = ''
  AND stored_at <= %(at)s AND (removed_at IS NULL OR removed_at > %(at)s)
""",
        {"at": middle},  # type: ignore[arg-type]
    )
    _sql(
        conn,
        "audit: which sources sent events the index refused, and why?",
        """
SELECT source, reason, count(*) AS events, min(detail) AS example
FROM kvledger.rejected_events
GROUP BY source, reason ORDER BY events DESC
""",
    )
    if middle is not None:
        print(
            f"   (the middle of the run: {middle:%H:%M:%S.%f}; runs spanned "
            f"{(last - first) / timedelta(seconds=1):.2f} s of event time)"
        )
