"""Lookup latency on an index of 1,024,000 blocks held across 64 instances.

The index is generated in SQL (8,000 chains of 128 blocks; each chain's prefixes held by two
instances on CPU and one on STORAGE), once, in database <database>_bench_lookup. Prompts of
128 hashes are drawn from the chains. Figures: p50/p99 latency via SQL, the Python API and
HTTP (a `kvledger serve` process), and lookups/s with 8 concurrent HTTP clients. The SQL
client sends the hash array as a binary parameter, as PrefixIndex does.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time

import httpx
import sqlalchemy as sa

from bench.common import lookup_service, percentiles_ms, post_times, reader_args, record, settle
from kvledger.consumer.db import connect, migrate
from kvledger.serving.lookup import PrefixIndex

CHAINS, LENGTH, INSTANCES = 8000, 128, 64
H = "decode(substr(md5(c::text || '/' || i::text), 1, 16), 'hex')"
HP = "decode(substr(md5(c::text || '/' || (i - 1)::text), 1, 16), 'hex')"


def _database(server: str) -> str:
    url = sa.engine.make_url(server)
    name = f"{url.database}_bench_lookup"
    with connect(server, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    out = url.set(database=name).render_as_string(hide_password=False)
    migrate(out)
    with connect(out, autocommit=True) as conn:
        # The generated instances publish nothing: mark them seen now, and give every
        # session a window that outlasts the benchmark, so that each lookup pays the
        # liveness check and keeps every holder.
        conn.execute(
            "INSERT INTO kvledger.sources (source, model, epoch, last_seen) "
            f"SELECT 'engine-' || i, 'bench', 1, now() FROM generate_series(0, {INSTANCES - 1}) i "
            "ON CONFLICT (source) DO UPDATE SET last_seen = now(), closed_at = NULL"
        )
    return (
        sa.engine.make_url(out)
        .update_query_dict({"options": "-ckvledger.silent_after=1d"})
        .render_as_string(hide_password=False)
    )


def populate(url: str) -> int:
    with connect(url, autocommit=True) as conn:
        (blocks,) = conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone() or (0,)
        if blocks >= CHAINS * LENGTH:
            return int(blocks)
        print("generating the index (once)...", file=sys.stderr)
        conn.execute("TRUNCATE kvledger.blocks, kvledger.residencies, kvledger.group_specs")
        conn.execute(
            "INSERT INTO kvledger.group_specs VALUES "
            "('bench', 0, 'full_attention', 16, 16, NULL, 'declared', NULL, now())"
        )
        conn.execute(
            f"""
            INSERT INTO kvledger.blocks (model, group_idx, block_hash, parent_hash, token_start,
                token_end, token_ids, block_size, partial, first_seen, last_seen)
            SELECT 'bench', 0, {H}, CASE WHEN i = 0 THEN NULL ELSE {HP} END, i * 16, i * 16 + 16,
                   array_fill(c, ARRAY[16]), 16, false, now(), now()
            FROM generate_series(0, {CHAINS - 1}) c, generate_series(0, {LENGTH - 1}) i
            """
        )
        conn.execute(
            f"""
            INSERT INTO kvledger.residencies (model, group_idx, block_hash, instance, medium,
                ownership, since, kafka_topic, kafka_partition, kafka_offset, refcount)
            SELECT 'bench', 0, {H}, 'engine-' || ((c * 7 + k * 13) % {INSTANCES}),
                   CASE WHEN k = 2 THEN 'STORAGE' ELSE 'CPU' END,
                   CASE WHEN k = 2 THEN 'disk' ELSE '' END, now(), 'bench', 0, 0, 1
            FROM generate_series(0, {CHAINS - 1}) c, generate_series(0, 2) k,
                 LATERAL generate_series(0, 16 + (c * 31 + k * 17) % {LENGTH - 16}) i
            """
        )
        # What autovacuum does in a live index: statistics and the visibility map (which
        # lets the residency probes be index-only scans).
        conn.execute("VACUUM ANALYZE kvledger.blocks")
        conn.execute("VACUUM ANALYZE kvledger.residencies")
        (blocks,) = conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone() or (0,)
        return int(blocks)


def _prompt_chain(rng: random.Random) -> int:
    """The chain a prompt follows (block i of chain c holds 16 tokens c)."""
    return rng.randrange(CHAINS)


def _prompt(rng: random.Random) -> list[bytes]:
    import hashlib

    c = _prompt_chain(rng)
    return [hashlib.md5(f"{c}/{i}".encode()).digest()[:8] for i in range(LENGTH)]


def main(lookups: int = 2000) -> dict[str, float]:
    url = _database(os.environ["KVLEDGER_DATABASE_URL"])
    blocks = populate(url)
    settle(url)
    rng = random.Random(1)
    prompts = [_prompt(rng) for _ in range(lookups)]
    # The prompts are long-lived: keep the collector from walking them inside timed calls.
    gc.collect()
    gc.freeze()
    figures: dict[str, float] = {"blocks": float(blocks), "instances": float(INSTANCES)}
    with connect(url, autocommit=True) as conn:
        (residencies,) = conn.execute("SELECT count(*) FROM kvledger.residencies").fetchone() or (
            0,
        )
        figures["residencies"] = float(residencies)
        # A lookup service runs warm: one index-only pass over the keys the lookups probe
        # loads them into PostgreSQL's buffer cache (as hours of traffic would).
        with conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            conn.execute("SET LOCAL enable_bitmapscan = off")
            # Conditions on each primary key's leading column: a scan of that key.
            conn.execute("SELECT count(*) FROM kvledger.residencies WHERE block_hash >= ''")
            conn.execute("SELECT count(*) FROM kvledger.blocks WHERE model = 'bench'")
        sql_times, api_times, held_times = [], [], []
        for hashes in prompts[:200]:  # warm-up
            conn.execute(
                "SELECT * FROM kvledger.match_prefix('bench', 0, %b)", (hashes,)
            ).fetchall()
        # Baseline in the same run: the same match without the liveness check.
        for hashes in prompts:
            start = time.perf_counter()
            conn.execute("SELECT * FROM kvledger.held_prefix('bench', 0, %b)", (hashes,)).fetchall()
            held_times.append(time.perf_counter() - start)
        for hashes in prompts:
            start = time.perf_counter()
            conn.execute(
                "SELECT * FROM kvledger.match_prefix('bench', 0, %b)", (hashes,)
            ).fetchall()
            sql_times.append(time.perf_counter() - start)
        index = PrefixIndex(conn)
        for hashes in prompts:
            start = time.perf_counter()
            index.match("bench", 0, hashes)
            api_times.append(time.perf_counter() - start)
    figures["SQL p50 ms"], figures["SQL p99 ms"] = percentiles_ms(sql_times)
    figures["SQL without liveness p50 ms"], figures["SQL without liveness p99 ms"] = percentiles_ms(
        held_times
    )
    figures["Python API p50 ms"], figures["Python API p99 ms"] = percentiles_ms(api_times)

    bodies = [{"model": "bench", "hashes": [h.hex() for h in p]} for p in prompts]
    with lookup_service([*reader_args(url), "--pool-size", "8"]) as base:
        figures["HTTP p50 ms"], figures["HTTP p99 ms"] = percentiles_ms(post_times(base, bodies))
        done = [0]
        lock = threading.Lock()

        def worker(offset: int) -> None:
            with httpx.Client(base_url=base) as client:
                for body in bodies[offset::8][:250]:
                    client.post("/v1/match", json=body)
                    with lock:
                        done[0] += 1

        start = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        figures["HTTP lookups/s, 8 concurrent clients"] = done[0] / (time.perf_counter() - start)
    record("lookup", figures)
    return figures


if __name__ == "__main__":
    main()
