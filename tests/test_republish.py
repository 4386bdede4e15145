"""`kvledger republish` heard by a router's own released code: Dynamo 1.6.1's standalone
indexer (``python -m dynamo.indexer``) registered with kvledger's endpoints instead of the
engines'. Three vLLM publishers (vLLM 0.33.0's ``ZmqEventPublisher`` from its wheel) feed
`kvledger relay`s into real Kafka; a router index follows the topic and republishes each
engine on vLLM's sockets. Dynamo is asked ``POST /query`` and held to the truth, through the
faults its indexer gets wrong when it dials the engines itself (tests/test_dynamo_faults.py):

- an engine restarts (sequence back to 0, an empty cache, no goodbye);
- an engine's removals fall past its replay buffer while no one listens;
- Dynamo's indexer itself restarts: re-registered, it holds the fleet again at once, with
  no engine saying anything (a snapshot answers its subscription);
- an engine dies for good: once silent past the window, Dynamo no longer names it.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from kvledger.consumer.db import connect
from kvledger.consumer.metrics import REGISTRY
from kvledger.producer.relay.config import RelayConfig, parse_group
from kvledger.producer.relay.relay import Relay
from kvledger.producer.relay.wire import decode_batch
from kvledger.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvledger.serving.republish.publisher import END_SEQ, Endpoint, Publisher
from kvledger.serving.router.index import RouterIndex
from tests.helpers.procs import free_port, require_dynamo, spawn
from tests.helpers.scripted_engines import (
    BLOCK,
    CHAINS,
    LENGTH,
    MODEL,
    TOKENS,
    Engine,
    lose_removals,
    prompts,
    relay,
    republished_fleet,
    start_dynamo_indexer,
    truth,
    wait_until,
)

pytestmark = pytest.mark.integration
require_dynamo()

SILENT_S = 4.0  # the liveness window (the relays heartbeat every second)


def register(dynamo: str, engine: Engine, endpoint: Endpoint) -> None:
    body = {
        "instance_id": engine.index, "endpoint": endpoint.pub,
        "replay_endpoint": endpoint.replay, "model_name": MODEL, "block_size": BLOCK,
    }  # fmt: skip
    assert httpx.post(f"{dynamo}/register", json=body).status_code == 201


def scores(dynamo: str, tokens: list[int]) -> dict[str, Any]:
    body = {"token_ids": tokens, "model_name": MODEL}
    answer: dict[str, Any] = httpx.post(f"{dynamo}/query", json=body).json()
    return answer.get("scores", {})


def wrong(dynamo: str, engines: list[Engine]) -> list[tuple[int, int]]:
    """The prompts (chain, blocks) Dynamo answers other than the truth."""
    return [(c, m) for c, m, tokens in prompts() if scores(dynamo, tokens) != truth(engines, c, m)]


def test_dynamos_indexer_fed_by_kvledger_stays_exact(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events, tmp_path
) -> None:
    topic = make_topic("republish", partitions=3)
    fleet = republished_fleet(vllm_kv_events, kafka_bootstrap, fresh_database, topic,
                              group_id, SILENT_S)  # fmt: skip
    engines, relays, endpoints = fleet.engines, fleet.relays, fleet.endpoints
    dynamo, proc = start_dynamo_indexer(tmp_path)
    for e, endpoint in zip(engines, endpoints, strict=True):
        register(dynamo, e, endpoint)
    sentinels = iter(range(CHAINS, len(TOKENS)))

    def settle(*moved: Engine) -> None:
        """Each engine named stores a chain of its own; wait until Dynamo shows it."""
        for e in moved:
            c = next(sentinels)
            e.store(c, 1)
            seen = lambda c=c, e=e: str(e.index) in scores(dynamo, TOKENS[c][:BLOCK])  # noqa: E731
            wait_until(f"Dynamo sees engine {e.index}'s sentinel", seen)

    def exact(when: str) -> None:
        """Dynamo answers every prompt as the engines hold them (its indexer applies what it
        hears on threads of its own: given a few seconds to)."""
        try:
            wait_until(when, lambda: wrong(dynamo, engines) == [], timeout=10)
        except AssertionError:
            raise AssertionError(f"{when}, Dynamo is wrong on {wrong(dynamo, engines)}") from None

    work = random.Random(5)
    try:
        engines[0].work(work, 60, range(CHAINS))
        engines[1].work(work, 60, range(3, CHAINS))
        engines[2].work(work, 60, range(CHAINS))
        for c in range(3, CHAINS):
            engines[1].store(c, LENGTH)
        settle(*engines)
        exact("in steady state")

        # An engine restarts (a crash: no goodbye), then serves chains 0-2 only: the index
        # ends what the old engine held, and Dynamo hears it as removals.
        engines[1].restart()
        engines[1].work(work, 30, range(3))
        settle(engines[1])
        exact("after an engine restart")

        # Engine 2's removals fall past its replay buffer while its relay is down: the
        # index records the loss and clears the engine, then holds what was replayed.
        lose_removals(engines, relays, 2, kafka_bootstrap, topic, settle)
        exact("after a lost gap")

        # Dynamo's indexer restarts: registered again, it holds the whole fleet from
        # kvledger's snapshots alone (no engine publishes meanwhile).
        proc.kill()
        proc.wait()
        dynamo, proc = start_dynamo_indexer(tmp_path, "dynamo-again")
        for e, endpoint in zip(engines, endpoints, strict=True):
            register(dynamo, e, endpoint)
        took = wait_until("Dynamo recovers the fleet", lambda: wrong(dynamo, engines) == [])
        print(f"Dynamo's indexer restarted: exact again {took:.1f} s after registering")

        # Engine 0 dies for good (and its relay with it): once silent past the window,
        # Dynamo is told it holds nothing.
        engines[0].publisher.shutdown()
        relays[0].stop()
        engines[0].held = [0] * len(TOKENS)
        took = wait_until("Dynamo forgets the dead engine",
                          lambda: wrong(dynamo, engines) == [], timeout=SILENT_S + 30)  # fmt: skip
        print(f"a dead engine left Dynamo's answers {took:.1f} s after it died")
    finally:
        fleet.stop()


def follow(held: set[bytes], events: list[Any]) -> None:
    """A subscriber's set of held hashes after ``events``."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            held.clear()
        elif isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update(e.block_hashes)


def test_replay_answers_from_retained_batches_or_a_snapshot(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events
) -> None:
    """vLLM's replay protocol on kvledger's socket: from a retained sequence number, the
    batches from there; from one older than retained (here: one a previous run of
    kvledger sent), a snapshot of what the engine holds, then the end marker; garbage gets
    no answer and stops nothing."""
    topic = make_topic("republish-replay")
    with one_engine_republished(
        vllm_kv_events, kafka_bootstrap, fresh_database, topic, group_id
    ) as (engine, endpoint, publisher):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint.pub)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(str(endpoint.replay))
        try:
            engine.store(0, 3)
            engine.store(1, 2)
            heard: list[tuple[int, list[Any]]] = []
            held: set[bytes] = set()  # what a subscriber of this socket holds
            deadline = time.monotonic() + 30
            while len(held) < 5:  # chain 0's three blocks and chain 1's two
                assert time.monotonic() < deadline, heard
                if sub.poll(500):
                    _topic, seq, payload = sub.recv_multipart()
                    events = decode_batch(payload).events
                    heard.append((int.from_bytes(seq, "big"), events))
                    follow(held, events)
            seqs = [s for s, _ in heard]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # dense
            assert seqs[0] >= publisher.base_seq

            def replay(start: int) -> list[tuple[int, list[Any]]]:
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                out = []
                while True:
                    assert dealer.poll(10_000), "no replay answer"
                    frames = dealer.recv_multipart()
                    assert frames[0] == b"" and len(frames) == 4
                    if frames[2] == END_SEQ:
                        assert frames[1] == b"" and frames[3] == b""
                        return out
                    out.append((int.from_bytes(frames[2], "big"), decode_batch(frames[3]).events))

            def resent() -> float:
                value = REGISTRY.get_sample_value(
                    "kvledger_republish_resent_batches_total", {"source": "engine-0"}
                )
                return value or 0.0

            before = resent()
            assert replay(seqs[-1]) == [heard[-1]]  # retained: as it was published
            assert replay(seqs[-1] + 1) == []  # nothing yet
            assert resent() == before + 1  # what a subscriber missed, counted
            dealer.send_multipart([b"", b"bad"])  # malformed: no answer, nothing stops
            for frames in ([b"x" * 100_000], [b"", b"", b""], [b"\xff" * 8]):
                dealer.send_multipart(frames)
            # A peer that asks for everything many times and leaves without reading, and a
            # subscriber that never reads: neither stops the others.
            rude = ctx.socket(zmq.DEALER)
            rude.connect(str(endpoint.replay))
            for _ in range(200):
                rude.send_multipart([b"", (0).to_bytes(8, "big")])
            deaf = ctx.socket(zmq.SUB)
            deaf.setsockopt(zmq.SUBSCRIBE, b"")
            deaf.setsockopt(zmq.RCVHWM, 1)
            deaf.connect(endpoint.pub)
            time.sleep(0.5)
            rude.close(linger=0)
            engine.store(2, 1)
            while len(held) < 6:  # the live stream goes on
                assert time.monotonic() < deadline + 30, heard
                if sub.poll(500):
                    _topic, seq, payload = sub.recv_multipart()
                    events = decode_batch(payload).events
                    heard.append((int.from_bytes(seq, "big"), events))
                    follow(held, events)
            old = replay(0)  # before anything this run sent: a snapshot
            assert isinstance(old[0][1][0], AllBlocksCleared)
            assert resent() == before + 1  # a snapshot is not a resend
            restated: set[bytes] = set()
            for _, events in old:
                follow(restated, events)
            assert restated == held
            assert [s for s, _ in old] == sorted(s for s, _ in old)
        finally:
            ctx.destroy(linger=0)


def test_the_command_republishes_every_source_on_one_multiplexed_socket(
    kafka_bootstrap, fresh_database, make_topic, vllm_kv_events, tmp_path
) -> None:
    """`kvledger republish` as an operator runs it: one source on its own sockets, every
    source on the multiplexed PUB under kv@<source>@<model>; SIGTERM ends it with status 0,
    and a malformed --source is one clear line."""
    kv = vllm_kv_events
    topic = make_topic("republish-cmd")
    engines = [Engine(kv, 0), Engine(kv, 1)]
    relays = [relay(e, kafka_bootstrap, topic) for e in engines]
    mux, pub = free_port(), free_port()
    log = open(tmp_path / "republish.log", "w")  # noqa: SIM115 - the child writes it
    proc = spawn(
        [sys.executable, "-m", "kvledger", "republish", "--source", f"engine-1={pub}",
         "--mux-port", str(mux), "--topic", topic, "--bootstrap", kafka_bootstrap,
         "--database-url", fresh_database, "--consumer-group", "republish-cmd"],
        stdout=log, stderr=log,
    )  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{mux}")
    own = ctx.socket(zmq.SUB)
    own.setsockopt(zmq.SUBSCRIBE, b"")
    own.connect(f"tcp://127.0.0.1:{pub}")
    try:
        held: dict[bytes, set[bytes]] = {}
        deadline = time.monotonic() + 60
        while len(held.get(b"kv@engine-0@m", ())) < 3 or len(held.get(b"kv@engine-1@m", ())) < 2:
            assert time.monotonic() < deadline, (held, (tmp_path / "republish.log").read_text())
            engines[0].store(0, 3)
            engines[1].store(1, 2)
            while sub.poll(300):
                name, _seq, payload = sub.recv_multipart()
                follow(held.setdefault(name, set()), decode_batch(payload).events)
        on_its_own: set[bytes] = set()
        while own.poll(1000):
            topic_, _seq, payload = own.recv_multipart()
            assert topic_ == b""
            follow(on_its_own, decode_batch(payload).events)
        assert on_its_own == held[b"kv@engine-1@m"]
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        ctx.destroy(linger=0)
        for r in relays:
            r.stop()
        for e in engines:
            e.publisher.shutdown()
    bad = subprocess.run(
        [sys.executable, "-m", "kvledger", "republish", "--source", "engine-1:6000"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "give NAME=PORT or NAME=PORT:REPLAY_PORT" in bad.stderr


def test_a_peer_that_asks_and_never_reads_stops_nothing(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events
) -> None:
    """One DEALER asks for every retained batch thousands of times and never reads: its
    queue fills and its answers are cut (counted), while an honest replay on the same socket
    is still answered and the live stream still flows, with the attacker connected and
    after it left; the replayed ring is shared, not copied per answer."""
    topic = make_topic("republish-rude")
    with one_engine_republished(
        vllm_kv_events, kafka_bootstrap, fresh_database, topic, group_id, buffer_steps=64
    ) as (engine, endpoint, publisher):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint.pub)
        try:
            outlet = wait_for_outlet(publisher, "engine-0", batches=1)
            for c in range(CHAINS):  # a batch for the ring per store: each waits for the last
                for j in range(1, LENGTH + 1):
                    published = outlet.next_seq
                    engine.store(c, j)
                    wait_until("the store republished", lambda p=published: outlet.next_seq > p, 10)
            first = outlet.ring[0][0]

            def cut() -> float:
                value = REGISTRY.get_sample_value(
                    "kvledger_republish_replays_total", {"outcome": "cut"}
                )
                return value or 0.0

            before = cut()
            rude = ctx.socket(zmq.DEALER)
            rude.setsockopt(zmq.RCVHWM, 1)
            rude.setsockopt(zmq.RCVBUF, 4096)
            rude.connect(str(endpoint.replay))
            for _ in range(20_000):
                rude.send_multipart([b"", first.to_bytes(8, "big")])
            wait_until("the rude peer's answers cut", lambda: cut() > before, timeout=30)

            honest = ctx.socket(zmq.DEALER)
            honest.connect(str(endpoint.replay))

            def replay_ok() -> bool:
                last = outlet.next_seq - 1
                honest.send_multipart([b"", last.to_bytes(8, "big")])
                if not honest.poll(2000):
                    return False
                frames = honest.recv_multipart()
                while frames[2] != END_SEQ:
                    assert int.from_bytes(frames[2], "big") >= last
                    assert honest.poll(2000), "an answer cut short"
                    frames = honest.recv_multipart()
                return True

            def live_ok(chain: int) -> bool:
                while sub.poll(0):
                    sub.recv_multipart()
                engine.evict(chain, 0)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    if sub.poll(200):
                        _topic, _seq, payload = sub.recv_multipart()
                        if any(isinstance(e, BlockRemoved) for e in decode_batch(payload).events):
                            return True
                return False

            assert replay_ok(), "an honest replay went unanswered while the rude peer waited"
            assert live_ok(0), "the live stream stopped while the rude peer waited"
            rude.close(linger=0)
            time.sleep(0.5)
            assert replay_ok() and live_ok(1)
            assert publisher.error is None
        finally:
            ctx.destroy(linger=0)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_many_peers_that_never_read_share_one_ring(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events
) -> None:
    """Thirty peers each ask once for a 16 MB ring and never read: what libzmq keeps for them
    is the ring's own bytes, not a copy per peer (the issue's 30 peers grew a process by
    391 MB). Batches of 48 KB are copied by libzmq unless frames go by reference, and the
    ring is well past what the kernel's socket buffers take for the peers."""
    topic = make_topic("republish-many")
    big = 256  # tokens a block: 64 blocks make a 48 KB batch
    kv = vllm_kv_events
    engine = Engine(kv, 0)
    relay_ = Relay(RelayConfig(
        endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint, source="engine-0",
        model=MODEL, bootstrap_servers=kafka_bootstrap, topic=topic,
        groups=[parse_group(f"0:full_attention:{big}", MODEL)], heartbeat_interval_s=1.0,
    ))  # fmt: skip
    relay_.start()
    assert relay_.ready(60)
    router = RouterIndex(kafka_bootstrap, topic, group_id)
    with connect(fresh_database) as conn:
        router.bootstrap(conn)
    router.start()
    endpoint = Endpoint(
        "engine-0", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    )
    publisher = Publisher(router, [endpoint], silent_after_s=60)
    publisher.start()
    ctx = zmq.Context()
    try:
        outlet = wait_for_outlet(publisher, "engine-0", batches=1)
        r = random.Random(5)
        parent = None
        for _ in range(340):
            published = outlet.next_seq
            hashes = [r.getrandbits(63) for _ in range(64)]
            engine.publisher.publish(kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
                block_hashes=hashes, parent_block_hash=parent,
                token_ids=[r.randrange(1 << 14, 1 << 16) for _ in range(64 * big)],
                block_size=big, lora_id=None, medium="GPU", lora_name=None,
            )]))  # fmt: skip
            parent = hashes[-1]
            # One store a batch of the ring (a chunk applied at once is one batch).
            deadline = time.monotonic() + 30
            while outlet.next_seq <= published:
                assert time.monotonic() < deadline, "a store was not republished"
                time.sleep(0.002)
        wait_until("a 16 MB ring", lambda: outlet.ring_bytes > 16 << 20, timeout=60)
        first = outlet.ring[0][0]

        def answered() -> float:
            value = REGISTRY.get_sample_value(
                "kvledger_republish_replays_total", {"outcome": "answered"}
            )
            return value or 0.0

        before, rss = answered(), _rss_bytes()
        peers = []
        for _ in range(30):
            peer = ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.RCVHWM, 1)
            peer.setsockopt(zmq.RCVBUF, 4096)
            peer.connect(str(endpoint.replay))
            peer.send_multipart([b"", first.to_bytes(8, "big")])
            peers.append(peer)
        wait_until("thirty answers queued", lambda: answered() >= before + 30, timeout=60)
        time.sleep(2.0)  # libzmq's I/O thread moves what the kernel takes
        grown = _rss_bytes() - rss
        ring_mib = outlet.ring_bytes / 2**20
        print(f"ring {ring_mib:.1f} MiB: 30 peers grew the process by {grown / 2**20:.1f} MiB")
        assert grown <= 64 << 20, f"30 never-reading peers grew the process by {grown >> 20} MiB"
        honest = ctx.socket(zmq.DEALER)
        honest.connect(str(endpoint.replay))
        honest.send_multipart([b"", (outlet.next_seq - 1).to_bytes(8, "big")])
        assert honest.poll(1000), "an honest replay waited over 1 s beside the thirty"
        assert publisher.error is None
    finally:
        ctx.destroy(linger=0)
        publisher.stop()
        router.stop()
        relay_.stop()
        engine.publisher.shutdown()


@contextlib.contextmanager
def one_engine_republished(
    kv: Any, bootstrap: str, database: str, topic: str, group_id: str, **options: Any
) -> Iterator[tuple[Engine, Endpoint, Publisher]]:
    """One vLLM publisher relayed into ``topic``, a router index following it, and the
    engine republished on sockets of its own (``options``: the Publisher's); all stopped
    after."""
    engine = Engine(kv, 0)
    relay_ = relay(engine, bootstrap, topic)
    router = RouterIndex(bootstrap, topic, group_id)
    with connect(database) as conn:
        router.bootstrap(conn)
    router.start()
    endpoint = Endpoint(
        "engine-0", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    )
    publisher = Publisher(router, [endpoint], silent_after_s=60, **options)
    publisher.start()
    try:
        yield engine, endpoint, publisher
    finally:
        publisher.stop()
        router.stop()
        relay_.stop()
        engine.publisher.shutdown()


def wait_for_outlet(publisher: Publisher, source: str, batches: int) -> Any:
    """The source's outlet once it retains at least ``batches`` batches."""

    def ready() -> bool:
        outlet = publisher.outlets.get(source)
        return outlet is not None and len(outlet.ring) >= batches

    wait_until(f"{batches} batches retained for {source}", ready, timeout=60)
    return publisher.outlets[source]


def test_a_relay_of_a_republished_stream_loses_nothing_on_first_contact(
    kafka_bootstrap, fresh_database, make_topic, group_id, vllm_kv_events
) -> None:
    """A relay that reads `kvledger republish` (whose batches are numbered from its start-up
    time, not 0) meets the stream with a snapshot that starts with AllBlocksCleared: what
    came before it is void, so nothing is recorded lost; later batches follow densely."""
    topic, again = make_topic("republish-source"), make_topic("republish-again")
    with one_engine_republished(
        vllm_kv_events, kafka_bootstrap, fresh_database, topic, group_id
    ) as (engine, endpoint, publisher):
        second: Relay | None = None
        try:
            engine.store(0, 3)
            outlet = wait_for_outlet(publisher, "engine-0", batches=2)
            second = Relay(RelayConfig(
                endpoint=endpoint.pub, replay_endpoint=endpoint.replay, source="engine-0-again",
                model=MODEL, bootstrap_servers=kafka_bootstrap, topic=again,
                groups=[parse_group(f"0:full_attention:{BLOCK}", MODEL)],
                heartbeat_interval_s=1.0,
            ))  # fmt: skip
            second.start()
            assert second.ready(60), "the relay did not synchronise with the republished stream"
            engine.store(1, 2)
            last = outlet.next_seq
            wait_until("the relay caught up", lambda: outlet.next_seq > last, 10)
            wait_until(
                "the relay caught up",
                lambda: second.ranks[0].committed_seq == outlet.next_seq - 1,  # type: ignore[union-attr]
                30,
            )
            lost = second.metrics.lost_batches.labels("engine-0-again")._value.get()
            assert lost == 0, f"{lost} batches recorded lost on first contact"
        finally:
            if second is not None:
                second.stop()
