"""vLLM's ``kv_cache_report_mode="full"``: an engine that re-announces the prefix blocks a
request reuses, with vLLM 0.33.0's own publisher, through `kvledger relay --report-mode
full`, Kafka and the consumer, into PostgreSQL and the router index.

vLLM builds a reuse report in ``BlockPool.emit_cached_block_events`` with the code that
builds a real store (``_build_block_stored_event``): the request's cached prefix from block
0, no parent, its token ids. The block pool itself needs torch, so the test builds each
report as that function does (read from the 0.33.0 wheel) and sends it with vLLM's own
event classes and ZMQ publisher; the bytes are vLLM's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType

import pytest

from kvledger.consumer.db import connect
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.relay import Relay
from kvledger.serving.lookup import PrefixIndex
from kvledger.serving.router.index import RouterIndex
from kvledger.vllm_engine import removed, stored
from tests.helpers.consuming import consume, residencies_of
from tests.helpers.procs import free_port

pytestmark = pytest.mark.integration

MODEL = "m"
CHAIN = [2**64 - 101, 2**64 - 102, 2**64 - 103]  # one prompt's three blocks of 4 tokens
TOKENS = list(range(700, 712))


@pytest.fixture
def topic(make_topic: Callable[..., str]) -> str:
    return make_topic("report-mode", partitions=2)


def _engine_life() -> list[list[object]]:
    """One engine's batches: a request computes the prompt (two stores, as vLLM caches
    blocks as they fill), two later requests reuse all of it (each reported as
    ``emit_cached_block_events`` reports it), then the blocks are evicted, once each."""
    return [
        [stored(CHAIN[:2], None, TOKENS[:8], 4)],
        [stored(CHAIN[2:], CHAIN[1], TOKENS[8:], 4)],
        [stored(CHAIN, None, TOKENS, 4)],  # a reuse report: block 0 on, no parent
        [stored(CHAIN[:2], None, TOKENS[:8], 4)],  # a shorter prompt's reuse report
        [removed(CHAIN[:1])],  # evicted from the cache: one removal per block
        [removed(CHAIN[1:])],
        [stored(CHAIN[:1], None, TOKENS[:4], 4)],  # computed again after its eviction
    ]


def test_reuse_reports_add_no_copy_where_the_engine_says_it_reports(
    kafka_bootstrap: str, fresh_database: str, topic: str, group_id: str,
    vllm_kv_events: ModuleType,
) -> None:  # fmt: skip
    """Two engines publish the same life; only one's relay says the engine reports reuse.
    Its index holds what the engine holds (the first block, once); the other's holds the
    reported blocks as second copies that no removal ever ends: the router would keep
    sending prompts to blocks that are gone."""
    kv = vllm_kv_events
    sources = {"reports": True, "assumed-incremental": False}
    for source, reports in sources.items():
        port, replay = free_port(), free_port()
        publisher = kv.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
        )
        relay = Relay(
            RelayConfig(
                endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                source=source, model=MODEL, bootstrap_servers=kafka_bootstrap, topic=topic,
                groups=[parse_group("0:full_attention:4", MODEL)], reports_reuse=reports,
            )
        )  # fmt: skip
        try:
            relay.start()
            assert relay.ready(60), "the relay did not resynchronise with the engine"
            life = _engine_life()
            for events in life:
                batch = kv.KVEventBatch(
                    ts=time.time(),
                    events=[getattr(kv, e.kind)(**e.fields) for e in events],  # type: ignore[attr-defined]
                )
                publisher.publish(batch)
            deadline = time.monotonic() + 60
            while relay.ranks[0].committed_seq != len(life) - 1:
                assert not relay.errors, relay.errors
                assert time.monotonic() < deadline, relay.ranks[0].committed_seq
                time.sleep(0.05)
        finally:
            relay.stop()
            publisher.shutdown()
    consume(kafka_bootstrap, fresh_database, topic, group_id, batch=3)

    first = CHAIN[0].to_bytes(8, "big")
    assert residencies_of(fresh_database, "reports") == {(0, first, "GPU", ""): 1}
    ghosts = residencies_of(fresh_database, "assumed-incremental")
    assert {h: n for (_, h, _, _), n in ghosts.items()} == {
        first: 3, CHAIN[1].to_bytes(8, "big"): 2, CHAIN[2].to_bytes(8, "big"): 1,
    }  # fmt: skip
    hour = timedelta(hours=1)
    with connect(fresh_database, autocommit=True) as conn:
        flags = dict(
            conn.execute("SELECT source, reports_reuse FROM kvledger.source_health").fetchall()
        )
        audit = conn.execute(
            "SELECT seq, noop_count FROM kvledger.events WHERE source = 'reports' "
            "AND reason = 'reported_reuse' ORDER BY seq"
        ).fetchall()
        held = PrefixIndex(conn).match_tokens(MODEL, 0, TOKENS, silent_after=hour)
        router = RouterIndex(kafka_bootstrap, topic, group_id)
        router.bootstrap(conn)
    assert flags == sources
    assert [n for _, n in audit] == [3, 2]  # the two reports, each naming only held blocks
    # By tokens: the reporting engine holds the first block only; the other appears to hold
    # the whole prompt. The router index, built from the same log, agrees with SQL.
    assert sorted((h.instance, h.matched_blocks) for h in held) == [
        ("assumed-incremental", 3), ("reports", 1),
    ]  # fmt: skip
    from_memory = router.match_tokens(MODEL, 0, TOKENS, silent_after=hour)
    assert sorted((h.instance, h.matched_blocks) for h in from_memory) == [
        ("assumed-incremental", 3), ("reports", 1),
    ]  # fmt: skip


def test_the_full_report_mode_needs_groups_to_announce_it() -> None:
    with pytest.raises(ValueError, match="--group"):
        RelayConfig("tcp://127.0.0.1:1", "s", MODEL, "localhost:1", reports_reuse=True)
