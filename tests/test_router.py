"""The router index against the SQL index, through real Kafka and PostgreSQL: the same
state and the same answers at the same log position, whether it was bootstrapped while
the consumer was writing, from an empty index, or again after a restart."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest
from starlette.testclient import TestClient

from kvledger.consumer.applier import stored_offsets
from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.core.model import GroupKey
from kvledger.consumer.db import connect
from kvledger.consumer.service import IndexConsumer
from kvledger.fleet import FleetConfig, prompt_hashes, random_tokens, system_prompts
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.schemas.events import BlockStored
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.router.index import RouterIndex
from kvledger.simulate_cmd import run_simulation
from tests.helpers.consuming import consume, wait_caught_up

pytestmark = pytest.mark.integration
WIDE = timedelta(days=1)  # the fleet has stopped publishing: compare every holder's state
LORA = "adapter-x"


def lora_chain(bootstrap: str, topic: str, fleet: FleetConfig) -> list[int]:
    """A LoRA engine stores system prompt 0's first blocks under an adapter (own hashes)."""
    pub = KVEventPublisher(
        PublisherConfig(bootstrap, "engine-lora", fleet.model, topic=topic, heartbeat_interval_s=0)
    )
    prompt = system_prompts(fleet)[0]
    parent = None
    events = []
    for j in range(4):
        h = (1000 + j).to_bytes(8, "big")
        tokens = tuple(prompt[j * 32 : (j + 1) * 32])
        events.append(
            BlockStored(
                (h,), parent, tokens, 32, None, "CPU", LORA, group_idx=0, token_start=j * 32
            )
        )
        parent = h
    pub.publish_events(events)
    pub.close(goodbye=False)
    return prompt


def router_state(router: RouterIndex) -> set[tuple[object, ...]]:
    store = router.store
    out = set()
    for (model, group), g in store.groups.items():
        for h, hid, count in g.residencies():
            out.add((model, group, h, *store.holders[hid], count))
    return out


def sql_state(url: str) -> set[tuple[object, ...]]:
    with connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT model, group_idx, block_hash, instance, medium, ownership, refcount "
            "FROM kvledger.residencies"
        ).fetchall()
    return {(m, g, bytes(h), i, md, o, c) for m, g, h, i, md, o, c in rows}


def prompts(fleet: FleetConfig, rng: random.Random, count: int) -> list[list[int]]:
    systems = system_prompts(fleet)
    out = []
    for _ in range(count):
        base = rng.choice(systems)
        cut = rng.randrange(0, len(base) + 1)
        tail = random_tokens(rng, rng.choice([0, 16, 40, 300]))
        out.append(base[:cut] + tail if rng.random() < 0.3 else base + tail)
    return out


def test_router_and_sql_give_the_same_answers(
    kafka_bootstrap, fresh_database, as_reader, make_topic, group_id
) -> None:
    topic = make_topic("router", partitions=6)
    fleet = FleetConfig(
        instances=4, requests=60, seed=41, misconfigured_source=True, gpu_capacity_blocks=64,
        restart=("engine-1", 30),
    )  # fmt: skip
    consumer = IndexConsumer(
        ConsumerConfig(kafka_bootstrap, fresh_database, topic, group_id, f"{topic}.dlq",
                       batch_size=300, batch_timeout_s=0.1)
    )  # fmt: skip
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    producer = threading.Thread(
        target=run_simulation,
        args=(kafka_bootstrap, topic, fleet, 6, False, 3000.0),  # paced, while consuming
        daemon=True,
    )
    producer.start()
    time.sleep(1.5)
    router = RouterIndex(kafka_bootstrap, topic, group_id)
    with connect(fresh_database) as conn:  # while the consumer is writing
        router.bootstrap(conn)
    router.start()
    try:
        producer.join(120)
        lora_prompt = lora_chain(kafka_bootstrap, topic, fleet)
        wait_caught_up(kafka_bootstrap, fresh_database, topic, group_id)
        consumer.stop()
        thread.join(30)
        with connect(fresh_database, autocommit=True) as conn:
            offsets = stored_offsets(conn, group_id, topic)
        router.wait_for(offsets)
        assert router.position().behind_messages == 0
        assert router_state(router) == sql_state(fresh_database)
        rng = random.Random(5)
        seen = {"tail": 0, "restart": 0}
        with connect(fresh_database, autocommit=True) as conn:
            index = PrefixIndex(conn)
            for tokens in prompts(fleet, rng, 2000):
                hashes = prompt_hashes(tokens, fleet)
                raw = prompt_hashes(tokens, fleet, per_hash=True)
                for sql, mem in (
                    (index.match(fleet.model, 0, hashes, "block", True, WIDE),
                     router.match(fleet.model, 0, hashes, "block", True, WIDE)),
                    (index.match(fleet.model, 0, raw, "hash", True, WIDE),
                     router.match(fleet.model, 0, raw, "hash", True, WIDE)),
                    (index.match_tokens(fleet.model, 0, tokens, None, True, WIDE),
                     router.match_tokens(fleet.model, 0, tokens, None, True, WIDE)),
                    (index.match(fleet.model, 0, hashes, "block", False, WIDE),
                     router.match(fleet.model, 0, hashes, "block", False, WIDE)),
                ):  # fmt: skip
                    assert [(h, h.source_state) for h in mem] == [(h, h.source_state) for h in sql]
                    seen["tail"] += any(h.matched_tokens % 32 for h in mem)
            lora_sql = index.match_tokens(fleet.model, 0, lora_prompt, LORA, True, WIDE)
            lora_mem = router.match_tokens(fleet.model, 0, lora_prompt, LORA, True, WIDE)
            restarts = conn.execute("SELECT count(*) FROM kvledger.restarts").fetchone()
        assert lora_mem == lora_sql and [h.instance for h in lora_mem] == ["engine-lora"]
        assert restarts == (1,) and seen["tail"] > 0
        assert router.store.specs.keys() >= {GroupKey(fleet.model, 0)}
        # The HTTP service from memory: the same bodies as from SQL, its position in /healthz.
        body = {"model": fleet.model, "token_ids": lora_prompt, "lora_name": LORA,
                "silent_after_s": 86400}  # fmt: skip
        with (
            TestClient(create_app(ServiceConfig(router=router))) as mem,
            TestClient(create_app(ServiceConfig(as_reader(fresh_database), 2))) as sql_app,
        ):
            health = mem.get("/healthz").json()
            assert health["mode"] == "memory" and health["position"]["behind_messages"] == 0
            assert (
                mem.post("/v1/match", json=body).json()
                == sql_app.post("/v1/match", json=body).json()
            )
            assert mem.get(f"/v1/blocks/{'00' * 8}").status_code == 400
    finally:
        router.stop()
        consumer.stop()


def test_a_router_from_an_empty_index_and_one_restarted_mid_stream(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    topic = make_topic("router-empty", partitions=3)
    fleet = FleetConfig(instances=3, requests=40, seed=43)
    first = RouterIndex(kafka_bootstrap, topic, group_id)
    with connect(fresh_database) as conn:
        first.bootstrap(conn)  # nothing yet: it follows from offset 0
    first.start()
    run_simulation(kafka_bootstrap, topic, fleet, partitions=3, show_progress=False)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    with connect(fresh_database, autocommit=True) as conn:
        offsets = stored_offsets(conn, group_id, topic)
    first.wait_for(offsets)
    first.stop()  # a router restarts: a new one bootstraps from the snapshot and follows
    assert router_state(first) == sql_state(fresh_database)
    run_simulation(kafka_bootstrap, topic, FleetConfig(instances=2, requests=20, seed=44), 3, False)
    second = RouterIndex(kafka_bootstrap, topic, group_id)
    with connect(fresh_database) as conn:
        second.bootstrap(conn)
    second.start()
    try:
        consume(kafka_bootstrap, fresh_database, topic, group_id)
        with connect(fresh_database, autocommit=True) as conn:
            offsets = stored_offsets(conn, group_id, topic)
        second.wait_for(offsets)
        assert router_state(second) == sql_state(fresh_database)
    finally:
        second.stop()


def answers_as_sql(
    router: RouterIndex, url: str, fleet: FleetConfig, rng: random.Random, count: int
) -> None:
    """The router answers ``count`` prompts by hashes and by tokens as the SQL index does."""
    with connect(url, autocommit=True) as conn:
        index = PrefixIndex(conn)
        for tokens in prompts(fleet, rng, count):
            hashes = prompt_hashes(tokens, fleet)
            with router.lock:
                mem = (
                    router.match(fleet.model, 0, hashes, "block", True, WIDE),
                    router.match_tokens(fleet.model, 0, tokens, None, True, WIDE),
                )
            assert mem == (
                index.match(fleet.model, 0, hashes, "block", True, WIDE),
                index.match_tokens(fleet.model, 0, tokens, None, True, WIDE),
            )


def test_a_bootstrapped_block_counts_as_seen_when_the_index_last_saw_it(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    """Blocks the index last saw stored two days ago: with a one-day block retention,
    those no one holds are past it when a router loads them, as they are to the index's
    own retention. The router forgets them at its first expiry, not a day after it
    started; a block the index saw stored just now stays; holders and answers are the SQL
    index's."""
    topic = make_topic("router-expiry-bootstrap", partitions=3)
    fleet = FleetConfig(instances=3, requests=60, seed=46, gpu_capacity_blocks=48)
    run_simulation(kafka_bootstrap, topic, fleet, partitions=3, show_progress=False)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    with connect(fresh_database, autocommit=True) as conn:
        conn.execute("UPDATE kvledger.blocks SET last_seen = now() - interval '2 days'")
        recent = conn.execute(
            "UPDATE kvledger.blocks SET last_seen = now() WHERE block_hash IN "
            "(SELECT block_hash FROM kvledger.blocks b WHERE NOT EXISTS (SELECT 1 FROM "
            "kvledger.residencies r WHERE r.block_hash = b.block_hash) LIMIT 20) "
            "RETURNING model, group_idx, block_hash"
        ).fetchall()
    assert recent  # the fleet evicted blocks: some are held by no one
    router = RouterIndex(kafka_bootstrap, topic, group_id, block_retention=timedelta(days=1))
    with connect(fresh_database) as conn:
        router.bootstrap(conn)
    loaded = sum(len(g) for g in router.store.groups.values())
    dropped = router.expire(force=True)
    assert 0 < dropped < loaded
    for model, group, h in recent:
        assert router.store.groups[GroupKey(model, group)].row(bytes(h)) is not None
    assert router_state(router) == sql_state(fresh_database)
    answers_as_sql(router, fresh_database, fleet, random.Random(9), 200)


def test_a_router_forgets_what_no_one_holds_and_still_answers_as_sql(
    kafka_bootstrap, fresh_database, make_topic, group_id
) -> None:
    """A router with a 1 s block retention forgets the blocks the fleet's engines evicted
    (while the index keeps its rows for a day); the same fleet again stores them anew, and
    the router then holds and answers what the index holds and answers."""
    topic = make_topic("router-expiry", partitions=3)
    fleet = FleetConfig(instances=3, requests=60, seed=45, gpu_capacity_blocks=48)
    run_simulation(kafka_bootstrap, topic, fleet, partitions=3, show_progress=False)
    consume(kafka_bootstrap, fresh_database, topic, group_id)
    router = RouterIndex(kafka_bootstrap, topic, group_id, block_retention=timedelta(seconds=1))
    with connect(fresh_database) as conn:
        router.bootstrap(conn)
    loaded = sum(len(g) for g in router.store.groups.values())
    router.start()
    try:
        deadline = time.monotonic() + 30
        while router.blocks_expired == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        with router.lock:  # the count moves with each slice expired, under this lock
            left = sum(len(g) for g in router.store.groups.values())
            expired = router.blocks_expired
        assert expired > 0 and left == loaded - expired
        with connect(fresh_database, autocommit=True) as conn:
            (rows,) = conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone()
        assert rows == loaded  # the index keeps its rows (a day by default)
        assert router_state(router) == sql_state(fresh_database)
        run_simulation(kafka_bootstrap, topic, fleet, partitions=3, show_progress=False)
        consume(kafka_bootstrap, fresh_database, topic, group_id)
        with connect(fresh_database, autocommit=True) as conn:
            offsets = stored_offsets(conn, group_id, topic)
        router.wait_for(offsets)
        assert router_state(router) == sql_state(fresh_database)
        answers_as_sql(router, fresh_database, fleet, random.Random(8), 500)
    finally:
        router.stop()
