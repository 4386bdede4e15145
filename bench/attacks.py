"""Issue 76's attacks, each on the kvledger process a user runs (`python -m kvledger.cli
...`, a child of this one), with what the issue's targets ask of each: the process's RSS
growth from before the attack to its end (target <= 64 MiB), the seconds from the attack's
end until an honest client is served (target <= 1 s), and, where the attack concerns
records, the valid ones lost or counted twice (target 0 / 0). Beside each, what the honest
client waits with no attack, in the same run.

1. `republish --source engine-0=.. --source engine-1=.. --mux-port ..`: one DEALER asks
   ``--replays`` replays from 0 and never reads (its receive queue 1 message, 4 KiB of
   kernel buffer). Honest: a SUB of engine-0 hears a new store live, then a replay from
   it on engine-0's socket is answered whole; again once the attacker left; SIGTERM's exit.
2. `republish`, a ring of ~16 MiB (340 stores of 64 blocks of 256 tokens, one batch each):
   30, then 100 DEALERs each ask once for the whole ring and never read. Honest as in 1.
3. `consume --decisions-topic` (its decisions recorder): NUL in a record's model and in an
   offer's instance, and one record id twice in a batch. Honest: a valid record after them
   recorded.
4. The same recorder: lying counts (2^31-1 blocks of a 1-block prompt), a record from 1970
   and one from the year 5135, and an id recorded earlier sent again in a later batch.
5. `serve` (SQL, the read-only login, an index of a simulated fleet: 8 instances, 400
   requests each): 300 concurrent `GET /v1/dashboard`, each its own window (as
   bench/dashboard_flood.py, which measures the lookups' p99 during it). Honest: a
   `POST /v1/match` after the flood; beside it, the slowest of those asked during it.
6. `relay --health-url`: the engine's health route drips its answer a byte every 0.8 s
   for ``--drip-seconds`` (the issue's 25 s) while the engine (kvledger.vllm_engine's ZMQ
   engine) publishes a batch every 0.3 s. Honest: the relay's Kafka messages during the
   drip, and the first after the route answers well again.
7. `sources` with $KVLEDGER_CONFIG=/dev/zero and with $KVLEDGER_DATABASE_URL_FILE=/dev/zero,
   and `serve --token-file /dev/zero`: the seconds until the command exits with its
   one-line error and its peak RSS (VmHWM, as wait4 reports it to a small launcher),
   beside the same command refusing a small bad file (its growth is the difference).

Every size is the issue's (attack 2's ring: 16 MiB here, 15.4 MB there).

Children run without $KVLEDGER_SCHEMA_REGISTRY (the default framing: no subject is left
behind); every topic and database made here is deleted, every process started is stopped.

`python -m bench.attacks` runs it alone (bench/results/attacks/).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import zmq
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from bench.common import PUBLISHED, lookup_service, publish, reader_args, record, settle
from bench.consume import _database, _messages
from bench.dashboard import _apply
from bench.dashboard_flood import _flood, _lookups, _match_body
from bench.http_attack import rss_mib
from kvledger.consumer.db import connect, drop_database
from kvledger.fleet import FleetConfig
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.producer.relay.wire import decode_batch
from kvledger.schemas.events import BlockStored, GroupSpec
from kvledger.schemas.topics import ensure_topic
from kvledger.vllm_engine import ZmqEngine, stored
from tests.helpers.procs import free_port

TARGET_MIB, TARGET_S = 64.0, 1.0
MODEL, BLOCK = "bench-attacks", 256
INF = float("inf")


@dataclass
class Outcome:
    """One attack's figures: the three the targets ask for, then the rest."""

    growth_mib: float
    served_s: float
    lost_twice: tuple[int, int] | None = None  # None: the attack concerns no records
    more: dict[str, Any] = field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f"RSS growth, MiB (target <= {TARGET_MIB:.0f})": self.growth_mib,
            f"honest client served after the attack's end, ms (target <= {TARGET_S * 1e3:,.0f})": (
                self.served_s * 1e3
            ),
        }
        if self.lost_twice is not None:
            out["valid lost / counted twice (target 0 / 0)"] = self.kept
        return {**out, **self.more}

    @property
    def kept(self) -> str:
        """Valid records lost / counted twice ("-": the attack concerns no records)."""
        return "-" if self.lost_twice is None else "{} / {}".format(*self.lost_twice)


# ---------------------------------------------------------------------- processes
def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KVLEDGER_SCHEMA_REGISTRY"}


@contextmanager
def _kvledger(args: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m kvledger.cli ARGS` running; stopped (SIGTERM) afterwards, its output shown
    when it ended by itself."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvledger.cli", *args], env=_env(),
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            yield proc
        finally:
            if proc.poll() not in (None, 0, -signal.SIGTERM):
                _show(log, f"kvledger {args[0]} ended by itself ({proc.returncode})")
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _show(log: IO[bytes], what: str) -> None:
    log.seek(0)
    tail = log.read().decode(errors="replace").splitlines()[-15:]
    print(f"!! {what}:\n   " + "\n   ".join(tail))


def _until(ok: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``ok()`` first holds, asked every 10 ms; inf when not within
    ``timeout``."""
    start = time.monotonic()
    while not ok():
        if time.monotonic() - start > timeout:
            return INF
        time.sleep(0.01)
    return time.monotonic() - start


def _wait(what: str, ok: Callable[[], bool], timeout: float = 120.0) -> None:
    if _until(ok, timeout) == INF:
        raise RuntimeError(f"{what}: not within {timeout:.0f} s")


@contextmanager
def _topics(*names: str) -> Iterator[None]:
    """Topics of one partition for the attack, deleted afterwards."""
    admin = AdminClient({"bootstrap.servers": os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]})
    for name in names:
        ensure_topic(admin, name, 1)
    try:
        yield
    finally:
        for future in admin.delete_topics(list(names)).values():
            try:
                future.result(30)
            except Exception as exc:  # one the command itself never made: nothing to delete
                print(f"   (topic not deleted: {exc})")


@contextmanager
def _scratch_database(name: str) -> Iterator[str]:
    server = os.environ["KVLEDGER_DATABASE_URL"]
    try:
        yield _database(server, name)
    finally:
        drop_database(server, name)


def _metric(port: int, name: str) -> float:
    """A sample of a command's /metrics (``name`` with its labels, as written there)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


# ---------------------------------------------------------------------- 1, 2: republish
@dataclass
class Republished:
    """A `kvledger republish` child fed by an embedded engine's publisher, and an honest
    SUB on engine-0's PUB that keeps what it hears: each batch's seq and size."""

    proc: subprocess.Popen[bytes]
    publisher: KVEventPublisher
    ctx: zmq.Context[zmq.Socket[bytes]]
    sub: zmq.Socket[bytes]
    replay: str
    metrics_port: int
    rng: random.Random = field(default_factory=lambda: random.Random(5))
    sizes: dict[int, int] = field(default_factory=dict)  # seq -> payload bytes

    def store(self, blocks: int = 4) -> bytes:
        """One store of ``blocks`` new blocks by engine-0; returns its last hash."""
        hashes = tuple(self.rng.getrandbits(63).to_bytes(8, "big") for _ in range(blocks))
        tokens = tuple(self.rng.randrange(1 << 14, 1 << 16) for _ in range(blocks * BLOCK))
        event = BlockStored(hashes, None, tokens, BLOCK, None, "GPU", None, group_idx=0)
        self.publisher.publish_events([event])
        self.publisher.flush(30)
        return hashes[-1]

    def heard(self, block: bytes, timeout: float = 30.0) -> int | None:
        """The seq of the batch the SUB hears ``block`` stored in, within ``timeout``."""
        deadline = time.monotonic() + timeout
        wanted = int.from_bytes(block, "big")
        while time.monotonic() < deadline:
            if not self.sub.poll(100):
                continue
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            self.sizes[seq] = len(payload)
            for event in decode_batch(payload).events:
                if isinstance(event, BlockStored) and wanted in _ints(event.block_hashes):
                    return seq
        return None

    def honest(self, timeout: float = 30.0) -> tuple[float, float]:
        """Seconds until a new store is heard live, then until a replay from it is answered
        whole on engine-0's replay socket (inf when it is not)."""
        start = time.monotonic()
        seq = self.heard(self.store(), timeout)
        if seq is None:
            return INF, INF
        live = time.monotonic() - start
        if not _replayed(self.ctx, self.replay, seq, timeout):
            return live, INF
        return live, time.monotonic() - start - live

    def honest_s(self) -> float:
        return sum(self.honest())

    def replays(self, outcome: str) -> int:
        """Replay requests so far with ``outcome`` (answered, cut), as republish counts them."""
        sample = f'kvledger_republish_replays_total{{outcome="{outcome}"}}'
        return int(_metric(self.metrics_port, sample))


def _ints(hashes: Any) -> set[int]:
    return {h if isinstance(h, int) else int.from_bytes(h, "big") for h in hashes}


def _replayed(
    ctx: zmq.Context[zmq.Socket[bytes]], address: str, start: int, timeout: float
) -> bool:
    """Whether a replay from ``start`` is answered to its end within ``timeout``."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if dealer.poll(100) and dealer.recv_multipart()[2] == b"\xff" * 8:
                return True
        return False
    finally:
        dealer.close(linger=0)


@contextmanager
def _republished(name: str) -> Iterator[Republished]:
    """`kvledger republish` of two sources and a mux port, as the issue ran it, on a topic
    and database of its own; engine-0 announced and heard once."""
    bootstrap = os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]
    topic = f"{name}-{uuid.uuid4().hex[:8]}"
    ports = [free_port() for _ in range(6)]
    args = ["republish", "--source", f"engine-0={ports[0]}:{ports[1]}",
            "--source", f"engine-1={ports[2]}:{ports[3]}", "--mux-port", str(ports[4]),
            "--metrics-port", str(ports[5]), "--topic", topic,
            "--consumer-group", f"{topic}-group"]  # fmt: skip
    with ExitStack() as stack:
        stack.enter_context(_topics(topic))
        url = stack.enter_context(_scratch_database(name.replace("-", "_")))
        proc = stack.enter_context(_kvledger([*args, "--database-url", url]))
        publisher = KVEventPublisher(PublisherConfig(bootstrap, "engine-0", MODEL, topic,
                                                     handoff_batches=0))  # fmt: skip
        stack.callback(publisher.close, 30, False)
        publisher.announce_group_spec(GroupSpec(MODEL, 0, "full_attention", BLOCK, BLOCK))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        stack.callback(ctx.destroy, 0)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{ports[0]}")
        republished = Republished(proc, publisher, ctx, sub, f"tcp://127.0.0.1:{ports[1]}",
                                  ports[5])  # fmt: skip
        _wait(
            "republish heard engine-0",
            lambda: republished.heard(republished.store(), 2) is not None,
        )
        yield republished


def _never_reading(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 4096)
    peer.setsockopt(zmq.SNDTIMEO, 10_000)  # a send the other side never takes: counted
    peer.connect(address)
    return peer


def attack_1(replays: int) -> dict[str, Outcome]:
    with _republished("bench-attack-replay") as r:
        for _ in range(48):
            r.heard(r.store())
        quiet = r.honest_s()
        before, cut = rss_mib(r.proc.pid), r.replays("cut")
        rude = _never_reading(r.ctx, r.replay)
        began, sent = time.monotonic(), 0
        with contextlib.suppress(zmq.Again):  # its queue full: the rest cannot be sent
            while sent < replays:
                rude.send_multipart([b"", (0).to_bytes(8, "big")])
                sent += 1
        ended = time.monotonic()
        served = r.honest_s()
        time.sleep(max(0.0, ended + 2.0 - time.monotonic()))  # libzmq moves what it can
        end_rss, cut = rss_mib(r.proc.pid), r.replays("cut") - cut
        rude.close(linger=0)
        time.sleep(0.5)
        after_left = r.honest_s()
        r.proc.terminate()
        stop_s = _until(lambda: r.proc.poll() is not None, 30)
        more = {
            "replay requests sent (never read)": f"{sent:,} of {replays:,}",
            "  sent in, s": ended - began,
            "  answers cut (counted)": cut,
            "RSS before / at the end, MiB": f"{before:.0f} / {end_rss:.0f}",
            "quiet: a store heard live and replayed, ms": quiet * 1e3,
            "after the attacker left: the same, ms": after_left * 1e3,
            "SIGTERM to exit, s": stop_s,
        }
    return {
        "1. republish: a replay asker never reads": Outcome(end_rss - before, served, None, more)
    }


def attack_2(peer_counts: list[int], stores: int) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}
    with _republished("bench-attack-ring") as r:
        first = r.heard(r.store(64))
        assert first is not None
        for _ in range(stores - 1):
            r.heard(r.store(64))
        ring_mib = sum(size for seq, size in r.sizes.items() if seq >= first) / 2**20
        quiet = r.honest_s()
        for n in peer_counts:
            out[f"2. republish: {n} peers ask the ring, never read"] = _many_peers(
                r, n, first, quiet, ring_mib
            )
    return out


def _many_peers(r: Republished, n: int, first: int, quiet: float, ring_mib: float) -> Outcome:
    before, answered = rss_mib(r.proc.pid), r.replays("answered")
    peers = [_never_reading(r.ctx, r.replay) for _ in range(n)]
    for peer in peers:
        peer.send_multipart([b"", first.to_bytes(8, "big")])
    ended = time.monotonic()
    live, replay = r.honest()
    time.sleep(max(0.0, ended + 2.0 - time.monotonic()))
    end_rss, queued = rss_mib(r.proc.pid), r.replays("answered") - answered
    for peer in peers:
        peer.close(linger=0)
    time.sleep(1.0)
    more = {
        "ring (replayed whole to each peer), MiB": ring_mib,
        "  answers queued (counted)": queued,
        "honest: the store heard live / the replay answered, ms": (
            f"{live * 1e3:.0f} / {replay * 1e3:.0f}"
        ),
        "RSS before / at the end / 1 s after they left, MiB": (
            f"{before:.0f} / {end_rss:.0f} / {rss_mib(r.proc.pid):.0f}"
        ),
        "quiet: a store heard live and replayed, ms": quiet * 1e3,
    }
    return Outcome(end_rss - before, live + replay, None, more)


# ---------------------------------------------------------------------- 3, 4: decisions
def _decision(ident: str | None = None, offer: dict[str, Any] | None = None,
              **changes: Any) -> tuple[str, bytes]:  # fmt: skip
    """A decision record as `serve --memory --decisions-topic` writes it (version 2), with
    ``changes`` to its fields; returns its id and bytes."""
    ident = ident or uuid.uuid4().hex
    record = {
        "id": ident, "at": time.time(), "block_size": 4, "prompt_blocks": 4,
        "available_blocks": 2, "silent_blocks": 0, "chosen_state": "live",
        "offered": [{"instance": "e-0", "medium": "GPU", "ownership": "", "blocks": 2,
                     "state": "live", **(offer or {})}],
        "captured_blocks": 2, "captured_tier": "GPU", "available_tier": "GPU",
    }  # fmt: skip
    body = {"v": 2, "model": MODEL, "group_idx": 0, "origin": "o", "instance": "e-0",
            "kind": "hashes", "keys": [1, 2], "record": record}  # fmt: skip
    for key, value in changes.items():
        (record if key in record else body)[key] = value
    return ident, json.dumps(body).encode()


@dataclass
class Recorder:
    """A `kvledger consume --decisions-topic` child, a producer to its decisions topic, and
    its database."""

    proc: subprocess.Popen[bytes]
    producer: Producer
    topic: str
    url: str

    def send(self, records: list[bytes]) -> float:
        """Produce ``records`` in order, acknowledged; returns when they were."""
        for raw in records:
            self.producer.produce(self.topic, raw)
        self.producer.flush(30)
        return time.monotonic()

    def rows(self) -> dict[str, int]:
        """Rows per decision id (uuid hex) in kvledger.decisions."""
        with connect(self.url, autocommit=True) as conn:
            got = conn.execute(
                "SELECT decision_id, count(*) FROM kvledger.decisions GROUP BY 1"
            ).fetchall()
        return {uuid.UUID(str(ident)).hex: n for ident, n in got}

    def refused(self) -> int:
        with connect(self.url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM kvledger.rejected_decisions").fetchone()
        return int(row[0]) if row else 0

    def honest_s(self, since: float | None = None) -> float:
        """Seconds from ``since`` (else now) until a valid record sent now is recorded."""
        since = since if since is not None else time.monotonic()
        ident, raw = _decision()
        self.send([raw])
        if _until(lambda: ident in self.rows(), 60) == INF:
            return INF
        return time.monotonic() - since


@contextmanager
def _recorder() -> Iterator[Recorder]:
    events = f"bench-attack-events-{uuid.uuid4().hex[:8]}"
    decisions = f"{events}-decisions"
    args = ["consume", "--topic", events, "--consumer-group", f"{events}-group",
            "--decisions-topic", decisions]  # fmt: skip
    with ExitStack() as stack:
        stack.enter_context(_topics(events, decisions, f"{events}.dlq"))
        url = stack.enter_context(_scratch_database("bench_attack_decisions"))
        proc = stack.enter_context(_kvledger([*args, "--database-url", url]))
        producer = Producer({"bootstrap.servers": os.environ["KVLEDGER_KAFKA_BOOTSTRAP"]})
        recorder = Recorder(proc, producer, decisions, url)
        ident, raw = _decision()
        recorder.send([raw])
        _wait("the recorder recorded its first record", lambda: ident in recorder.rows())
        yield recorder


def _recorder_attack(r: Recorder, valid: list[str], attack: list[bytes],
                     refusals: int) -> Outcome:  # fmt: skip
    """Send ``attack`` (valid records among it by ``valid``'s ids), then one valid record:
    the seconds until it is recorded, and every valid one recorded once."""
    before, refused = rss_mib(r.proc.pid), r.refused()
    quiet = r.honest_s()
    served = r.honest_s(since=r.send(attack))
    end_rss = rss_mib(r.proc.pid)
    rows = r.rows()
    lost = sum(ident not in rows for ident in valid)
    twice = sum(n > 1 for n in rows.values())
    more = {
        f"refused into rejected_decisions (expected {refusals})": r.refused() - refused,
        "RSS before / at the end, MiB": f"{before:.0f} / {end_rss:.0f}",
        "quiet: a valid record recorded after, ms": quiet * 1e3,
    }
    return Outcome(end_rss - before, served, (lost, twice), more)


def attack_3_4() -> dict[str, Outcome]:
    with _recorder() as r:
        twice, also = uuid.uuid4().hex, uuid.uuid4().hex
        poison = [
            _decision(twice)[1], _decision(twice)[1],  # one id twice in a batch
            _decision(model="m\u0000")[1], _decision(offer={"instance": "e\u0000"})[1],
            _decision(also)[1],
        ]  # fmt: skip
        third = _recorder_attack(r, [twice, also], poison, 2)
        lying = [
            _decision(prompt_blocks=1, available_blocks=2**31 - 1, captured_blocks=2**31 - 1)[1],
            _decision(at=0.0)[1], _decision(at=99_999_999_999.0)[1],
            _decision(twice)[1],  # recorded in the attack before: a later batch
        ]  # fmt: skip
        fourth = _recorder_attack(r, [twice, also], lying, 3)
    return {
        "3. recorder: poison records (NUL, one id twice)": third,
        "4. recorder: lying records (counts, 1970, 5135, a repeat)": fourth,
    }


# ---------------------------------------------------------------------- 5: dashboard
def _serving_pid(base: str) -> int:
    """The pid of this process's `kvledger serve` child listening at ``base``."""
    port = str(urllib.parse.urlsplit(base).port)
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
        if parent == os.getpid() and "serve" in argv and port in argv:
            return int(entry)
    raise RuntimeError(f"no kvledger serve child at {base}")


def _match_s(base: str, body: bytes) -> float:
    """Seconds one `POST /v1/match` on a new connection took to be answered 200 (inf
    otherwise)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=300)
    start = time.monotonic()
    try:
        conn.request("POST", "/v1/match", body, {"content-type": "application/json"})
        answer = conn.getresponse()
        answer.read()
    finally:
        conn.close()
    return time.monotonic() - start if answer.status == 200 else INF


def attack_5(requests: int = 400) -> dict[str, Outcome]:
    fleet = FleetConfig(instances=8, requests=requests, seed=5)
    with _scratch_database("bench_attack_dashboard") as url:
        _apply(url, _messages(fleet), "bench")
        settle(url)
        body = _match_body(fleet)
        with lookup_service(reader_args(url)) as base:
            pid = _serving_pid(base)
            quiet = min(_match_s(base, body) for _ in range(20))
            before = rss_mib(pid)
            during: list[float] = []
            done = threading.Event()
            honest = threading.Thread(target=lambda: during.extend(_lookups(base, body, done)))
            honest.start()
            statuses, flood_s = _flood(base)
            done.set()
            honest.join()
            served, end_rss = _match_s(base, body), rss_mib(pid)
    more = {
        "GET /v1/dashboard statuses of 300": ", ".join(
            f"{s}: {n}" for s, n in sorted(statuses.items())
        ),
        "  the flood's 300 answered within, s": flood_s,
        f"the slowest of {len(during)} /v1/match during the flood, ms": max(during) * 1e3,
        "RSS before / at the end, MiB": f"{before:.0f} / {end_rss:.0f}",
        "quiet: a /v1/match, ms (best of 20)": quiet * 1e3,
    }
    return {
        "5. serve: 300 dashboard windows at once": Outcome(end_rss - before, served, None, more)
    }


# ---------------------------------------------------------------------- 6: relay
class _Health(http.server.BaseHTTPRequestHandler):
    """An engine's health route: 200, or while ``drip`` is set, the same a byte every
    0.8 s."""

    drip = threading.Event()

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.drip.is_set():
            with contextlib.suppress(OSError):  # the relay gave up on it: as it should
                for byte in b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n":
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.8)
            return
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()


class _Arrivals:
    """When each message of a topic arrived here (monotonic), read on a thread."""

    def __init__(self, topic: str) -> None:
        self.times: list[float] = []
        self._stop = threading.Event()
        self._consumer = Consumer({
            "bootstrap.servers": os.environ["KVLEDGER_KAFKA_BOOTSTRAP"],
            "group.id": f"{topic}-reader", "enable.auto.commit": False,
            "isolation.level": "read_committed",
        })  # fmt: skip
        self._consumer.assign([TopicPartition(topic, 0, 0)])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self._consumer.consume(100, timeout=0.05):
                if msg.error() is None:
                    self.times.append(time.monotonic())

    def first_after(self, since: float, timeout: float = 30.0) -> float:
        """Seconds from ``since`` to the first message that arrived after it (inf: none)."""
        if _until(lambda: any(t > since for t in self.times), timeout) == INF:
            return INF
        return min(t for t in self.times if t > since) - since

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


def _batch(engine: ZmqEngine, rng: random.Random) -> float:
    hashes = [rng.getrandbits(63) for _ in range(4)]
    engine.publish([stored(hashes, None, [rng.randrange(50_000) for _ in range(64)], 16)])
    return time.monotonic()


def attack_6(drip_s: float) -> dict[str, Outcome]:
    topic = f"bench-attack-relay-{uuid.uuid4().hex[:8]}"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine, rng = ZmqEngine(0, 0), random.Random(6)
    args = ["relay", "--endpoint", engine.endpoint, "--replay-endpoint", engine.replay_endpoint,
            "--source", "dripped", "--model", MODEL, "--group", "0:full_attention:16",
            "--topic", topic, "--heartbeat-interval", "0.3",
            "--health-url", f"http://127.0.0.1:{server.server_port}/health"]  # fmt: skip
    try:
        with _topics(topic), _kvledger(args) as proc:
            arrivals = _Arrivals(topic)
            try:
                _wait("the relay's first message", lambda: bool(arrivals.times))
                quiet = arrivals.first_after(_batch(engine, rng))
                before = rss_mib(proc.pid)
                served, during, batches = _drip(engine, rng, arrivals, drip_s)
                end_rss = rss_mib(proc.pid)
            finally:
                arrivals.close()
    finally:
        _Health.drip.clear()
        server.shutdown()
        engine.close()
    more = {
        f"Kafka messages during the drip (engine batches: {batches})": during,
        "RSS before / at the end, MiB": f"{before:.0f} / {end_rss:.0f}",
        "quiet: an engine batch in Kafka after, ms": quiet * 1e3,
    }
    name = f"6. relay: its health route drips for {drip_s:.0f} s"
    return {name: Outcome(end_rss - before, served, None, more)}


def _drip(
    engine: ZmqEngine, rng: random.Random, arrivals: _Arrivals, drip_s: float
) -> tuple[float, int, int]:
    """The route drips for ``drip_s`` (2 s of them idle: the relay's probes meet it, then a
    batch every 0.3 s); then it answers well and one more batch is published. Returns the
    seconds from then until a message arrives, the messages that arrived during the drip,
    and the batches published during it."""
    _Health.drip.set()
    began, batches = time.monotonic(), 0
    time.sleep(2.0)
    while time.monotonic() - began < drip_s:
        _batch(engine, rng)
        batches += 1
        time.sleep(0.3)
    _Health.drip.clear()
    ended = _batch(engine, rng)
    served = arrivals.first_after(ended)
    return served, sum(began < t <= ended for t in arrivals.times), batches


# ---------------------------------------------------------------------- 7: files
# A small launcher (Python with only os, sys and time loaded) that spawns the command with
# posix_spawn and reports its seconds to exit, its peak RSS (KiB) and its exit code: a child
# forked from this process would inherit this process's peak as its own.
_LAUNCH = (
    "import os, sys, time\n"
    "start = time.monotonic()\n"
    "quiet = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)]\n"
    "pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ, file_actions=quiet)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "print(time.monotonic() - start, usage.ru_maxrss, os.waitstatus_to_exitcode(status))\n"
)


def _refused(args: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run `kvledger ARGS` to its end: seconds to exit, peak RSS (MiB), and its stderr (it
    must have failed)."""
    command = [sys.executable, "-S", "-c", _LAUNCH, sys.executable, "-m", "kvledger.cli", *args]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=True)
    seconds, peak_kib, code = run.stdout.split()
    said = run.stderr.strip()
    if int(code) == 0:
        raise RuntimeError(f"kvledger {' '.join(args)} did not refuse: {said}")
    return float(seconds), int(peak_kib) / 1024, said


def _file_attack(args: list[str], variable: str | None, small: str) -> Outcome:
    """``args`` with /dev/zero where a file is named (``variable``, else the last
    argument), beside the same with the small bad file ``small``."""

    def run(path: str) -> tuple[float, float, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        if variable is None:
            return _refused([*args, path], env)
        return _refused(args, {**env, variable: path})

    seconds, peak, said = run("/dev/zero")
    base_s, base_peak, base_said = run(small)
    one_line = len(said.splitlines()) == 1 and "Traceback" not in said
    more = {
        "one-line error": f"{one_line}: {said[:100]}",
        "peak RSS (VmHWM), MiB: /dev/zero / a small bad file": f"{peak:.0f} / {base_peak:.0f}",
        "a small bad file: exits in, ms": base_s * 1e3,
        "  its error": base_said[:100],
    }
    return Outcome(peak - base_peak, seconds, None, more)


def attack_7() -> dict[str, Outcome]:
    with tempfile.TemporaryDirectory() as scratch:
        bad_toml, empty = os.path.join(scratch, "bad.toml"), os.path.join(scratch, "empty")
        with open(bad_toml, "w", encoding="ascii") as f:
            f.write("[sources\n")
        open(empty, "w").close()
        db = ["--database-url", "postgresql+psycopg://u@127.0.0.1:1/d"]
        return {
            "7. $KVLEDGER_CONFIG=/dev/zero (sources)": _file_attack(
                ["sources"], "KVLEDGER_CONFIG", bad_toml
            ),
            "7. $KVLEDGER_DATABASE_URL_FILE=/dev/zero (sources)": _file_attack(
                ["sources"], "KVLEDGER_DATABASE_URL_FILE", empty
            ),
            "7. serve --token-file /dev/zero": _file_attack(
                ["serve", *db, "--token-file"], None, empty
            ),
        }


# ---------------------------------------------------------------------- the run
def _table(outcomes: dict[str, Outcome]) -> None:
    print(f"\n{'attack':<58} | {'RSS growth MiB':>14} | {'honest served after s':>21} | "
          "valid lost/twice")  # fmt: skip
    print(f"{'(target)':<58} | {'<= 64':>14} | {'<= 1':>21} | 0 / 0")
    for name, o in outcomes.items():
        print(f"{name:<58} | {o.growth_mib:>14.1f} | {o.served_s:>21.3f} | {o.kept}")


def main(args: argparse.Namespace) -> dict[str, Outcome]:
    runs: dict[str, Callable[[], dict[str, Outcome]]] = {
        "1": lambda: attack_1(args.replays),
        "2": lambda: attack_2(args.peers, args.ring_stores),
        "3": attack_3_4,
        "5": attack_5,
        "6": lambda: attack_6(args.drip_seconds),
        "7": attack_7,
    }
    outcomes: dict[str, Outcome] = {}
    for key, run in runs.items():
        if key in args.only:
            outcomes.update(run())
    for name, outcome in outcomes.items():
        record(name, outcome.figures())
    _table(outcomes)
    return outcomes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m bench.attacks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--replays", type=int, default=20_000, help="attack 1's requests")
    parser.add_argument("--peers", type=int, nargs="+", default=[30, 100], help="attack 2's")
    parser.add_argument("--ring-stores", type=int, default=340, help="attack 2's ring")
    parser.add_argument("--drip-seconds", type=float, default=25.0, help="attack 6's drip")
    parser.add_argument("--only", default="123567", help="attacks to run (3 runs 3 and 4)")
    options = parser.parse_args()
    done = main(options)
    written = publish({name: o.figures() for name, o in done.items()}, PUBLISHED / "attacks",
                      command="python -m bench.attacks")  # fmt: skip
    print(f"wrote {', '.join(str(w) for w in written)}")
