"""Read scaling on PostgreSQL's own machinery: a hot standby (streaming replication, started
by `scripts/services up standby`) answers lookups exactly as its primary once it has
replayed the same WAL, and `kvledger serve` pointed at it reports its replay lag."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from kvledger.consumer.db import connect, create_database, migrate
from kvledger.fleet import FleetConfig, prompt_hashes, random_tokens, system_prompts
from kvledger.serving.lookup import PrefixIndex
from kvledger.simulate_cmd import run_simulation
from tests.helpers.consuming import consume
from tests.helpers.procs import first_answer, free_port, reap, spawn

pytestmark = pytest.mark.integration
SERVICES = str(Path(__file__).resolve().parents[1] / "scripts" / "services")
WIDE = 365 * 86400.0  # the fleet stops before the comparison: a window that outlasts it


def _env_of(env: dict[str, str]) -> dict[str, str]:
    printed = subprocess.run(
        [SERVICES, "env"], env=env, check=True, capture_output=True, text=True
    ).stdout
    return dict(line.removeprefix("export ").split("=", 1) for line in printed.splitlines())


def test_a_hot_standby_answers_as_its_primary(
    kafka_bootstrap: str, tmp_path: Path, group_id: str
) -> None:
    from datetime import timedelta

    state = tempfile.mkdtemp(prefix="kvledger-standby-")
    env = dict(
        os.environ, KVLEDGER_STATE_DIR=state, KVLEDGER_PG_PORT=str(free_port()),
        KVLEDGER_PG_STANDBY_PORT=str(free_port()),
    )  # fmt: skip
    subprocess.run([SERVICES, "up", "postgres"], env=env, check=True)
    try:
        urls = _env_of(env)
        primary = create_database(urls["KVLEDGER_DATABASE_URL"], "kvl_standby")
        migrate(primary)
        subprocess.run([SERVICES, "up", "standby"], env=env, check=True)
        urls = _env_of(env)
        standby = sa.engine.make_url(urls["KVLEDGER_STANDBY_LOOKUP_DATABASE_URL"])
        standby_url = standby.set(database="kvl_standby").render_as_string(hide_password=False)

        topic = f"standby-{group_id}"
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(30)
        fleet = FleetConfig(instances=4, requests=60, seed=17)
        run_simulation(kafka_bootstrap, topic, fleet, partitions=3, show_progress=False)
        consume(kafka_bootstrap, primary, topic, group_id)  # writes reach the standby by WAL

        with connect(primary, autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            assert row is not None
            target = row[0]
        deadline = time.monotonic() + 60
        with connect(standby_url, autocommit=True) as conn:
            while True:
                caught = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)
                ).fetchone()
                if caught and caught[0]:
                    break
                assert time.monotonic() < deadline, "the standby did not catch up"
                time.sleep(0.2)
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)

        rng = random.Random(5)
        prompts = [system_prompts(fleet)[i % 3] + random_tokens(rng, 40) for i in range(60)]
        window = timedelta(seconds=WIDE)
        with connect(primary, autocommit=True) as p, connect(standby_url, autocommit=True) as s:
            held = 0
            for tokens in prompts:
                hashes = prompt_hashes(tokens, fleet)
                on_primary = PrefixIndex(p).match(fleet.model, 0, hashes, silent_after=window)
                on_standby = PrefixIndex(s).match(fleet.model, 0, hashes, silent_after=window)
                assert on_standby == on_primary
                by_tokens = PrefixIndex(s).match_tokens(fleet.model, 0, tokens, silent_after=window)
                assert by_tokens == PrefixIndex(p).match_tokens(
                    fleet.model, 0, tokens, silent_after=window
                )
                held += bool(on_primary)
            assert held > 10  # the comparison covered real matches
            tables = ("blocks", "residencies", "residency_history", "events")
            for table in tables:
                count = f"SELECT count(*) FROM kvledger.{table}"
                assert s.execute(count).fetchone() == p.execute(count).fetchone(), table

        # `kvledger serve` on the standby: read-only answers, its replay lag in /healthz.
        port = free_port()
        spawn(
            [sys.executable, "-m", "kvledger", "serve", "--database-url", standby_url,
             "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        health = first_answer(f"{base}/healthz", "serve on the standby")
        assert health.status_code == 200
        body = health.json()
        assert body["standby"] is True and body["replay_lag_s"] is not None
        assert body["replay_lag_s"] >= 0
        hashes = prompt_hashes(prompts[0], fleet)
        answer = httpx.post(f"{base}/v1/match", json={
            "model": fleet.model, "hashes": [h.hex() for h in hashes], "silent_after_s": WIDE,
        }).json()  # fmt: skip
        with connect(primary, autocommit=True) as conn:
            want = PrefixIndex(conn).match(fleet.model, 0, hashes, silent_after=window)
        assert [(h["instance"], h["matched_blocks"]) for h in answer["holders"]] == [
            (h.instance, h.matched_blocks) for h in want
        ]
        admin.delete_topics([topic, f"{topic}.dlq"])
    finally:
        reap()
        subprocess.run([SERVICES, "down", "postgres"], env=env, check=False)
        subprocess.run(["rm", "-rf", state], check=False)
