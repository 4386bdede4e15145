"""What `kvledger demo` prints once the index is built: each part of the report, with the SQL
that answers it (what a restart dropped, the relayed engine's blocks, a routing decision,
two audits)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg

from kvledger.fleet import FULL_GROUP, FleetConfig, prompt_hashes, random_tokens, system_prompts
from kvledger.producer.relay.relay import Relay
from kvledger.serving.lookup import PrefixIndex, rank
from kvledger.serving.lookup.api import tied
from kvledger.tables import print_table
from kvledger.vllm_engine import VllmWireSink, ZmqEngine

RESTARTED = "engine-0"  # the simulated engine that crashes and restarts mid-run
# The simulated engines stop publishing when the simulation ends; the demo's lookups count
# them as live for this long (the default window is 30 s).
DEMO_WINDOW = timedelta(minutes=10)


def section(title: str) -> None:
    print(f"\n== {title}")


def sql(conn: psycopg.Connection, title: str, query: str, params: Sequence[object] = ()) -> None:
    section(title)
    print("   " + "\n   ".join(line for line in pasteable(query, params).strip().splitlines()))
    cur = conn.execute(query, params)
    header = [d.name for d in cur.description or []]
    print_table(header, cur.fetchall(), indent="   ")


def pasteable(query: str, params: object) -> str:
    """The query as psql takes it: each ``%(name)s`` replaced by its value as an SQL string
    literal (the report printed the placeholders, which psql cannot run)."""
    if not isinstance(params, dict):
        return query
    for name, value in params.items():
        literal = "'" + str(value).replace("'", "''") + "'"
        query = query.replace(f"%({name})s", literal)
    return query


def relayed(
    conn: psycopg.Connection, relay: Relay, engine: ZmqEngine, wire: VllmWireSink, done: bool
) -> None:
    """The relayed engine's part: what it sent, what its relay did (``done``: it committed
    every batch), what the index holds of it."""
    m = relay.metrics
    source = relay.config.source  # one rank: its source is the relay's

    def count(metric: Any) -> int:
        return int(metric.labels(source)._value.get())

    section(f"{source}: a stock vLLM engine through `kvledger relay`")
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
    sql(
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
    print(
        f"   {row[0] if row else 0} of its messages applied (the relayed events and the relay's "
        "own group announcements and heartbeats); nothing recorded lost"
    )


def routing(conn: psycopg.Connection, fleet: FleetConfig) -> None:
    prompts = system_prompts(fleet)
    prompt = prompts[0] + random_tokens(random.Random("router"), 300)
    hashes = prompt_hashes(prompt, fleet)
    index = PrefixIndex(conn)
    holders = index.match(fleet.model, FULL_GROUP.group_idx, hashes, silent_after=DEMO_WINDOW)
    section("one routing decision")
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
        held = max(best.tokens_by_tier.values())
        sharing = tied(ranked)
        if len(sharing) > 1:
            print(
                f"   → a {len(sharing)}-way tie at score {best.score:,.0f} ({', '.join(sharing)}): "
                f"each holds {held} of the prompt's {len(prompt)} tokens on its best tier; a "
                "router breaks the tie by load"
            )
        else:
            print(
                f"   → route to {best.instance}: it already holds {held} of the prompt's "
                f"{len(prompt)} tokens"
            )
    else:
        print("   → no instance holds this prefix: route by load")


def restarted(conn: psycopg.Connection) -> None:
    sql(
        conn,
        f"{RESTARTED} crashed and restarted: what the index dropped (view kvledger.restarts)",
        """
SELECT source, previous_epoch, epoch, restarted_at, ended_gpu, ended_cpu, ended_storage
FROM kvledger.restarts
""",
    )
    sql(
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


def misconfigured(conn: psycopg.Connection) -> None:
    """Why the misconfigured engine holds anything at all: which of its group-0 blocks the
    index took (partial tails, whose size is the group's hash size, and placeholders)."""
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE b.partial), count(*) FILTER (WHERE b.block_size = 0), "
        "count(*) FROM kvledger.residencies r JOIN kvledger.blocks b "
        "USING (model, group_idx, block_hash) "
        "WHERE r.instance = 'engine-misconfigured' AND r.group_idx = 0"
    ).fetchone()
    partial, placeholders, held = row if row is not None else (0, 0, 0)
    if held:
        print(
            f"   engine-misconfigured holds {held} group-0 block(s) all the same: {partial} "
            f"partial tail(s) (16 tokens, the group's hash size: valid) and {placeholders} "
            "placeholder(s); each of its full stores (16-token blocks where the group says "
            "32) was refused (the last audit below)"
        )


def audits(conn: psycopg.Connection) -> None:
    row = conn.execute(
        "SELECT min(stored_at), max(coalesce(removed_at, stored_at)) "
        "FROM kvledger.residency_history"
    ).fetchone()
    assert row is not None
    first, last = row
    middle = first + (last - first) / 2 if first and last else None
    sql(
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
    if middle is not None:  # under the audit it explains, not the next one
        print(
            f"   (the middle of the run: {middle:%H:%M:%S.%f}; runs spanned "
            f"{(last - first) / timedelta(seconds=1):.2f} s of event time)"
        )
    sql(
        conn,
        "audit: which sources sent events the index refused, and why?",
        """
SELECT source, reason, count(*) AS events, min(detail) AS example
FROM kvledger.rejected_events
GROUP BY source, reason ORDER BY events DESC
""",
    )
