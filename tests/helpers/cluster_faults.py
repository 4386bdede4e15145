"""The cluster tests' faults beyond a killed node: one broker cut off the network (iptables,
as root), and a scripted vLLM engine relayed into the cluster in Kafka transactions, with
where its transactional id's coordinator lives and what of it reached the log."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from kvledger.producer.relay.position import partition_for
from kvledger.producer.relay.relay import Relay
from kvledger.producer.vllm import hash_bytes
from kvledger.schemas.codec import Codec
from kvledger.schemas.topics import message_key
from tests.helpers.scripted_engines import TOKENS, Engine, block_hash

TRANSACTION_STATE = "__transaction_state"


# ---------------------------------------------------------------- a broker cut off
def cut_unavailable() -> str | None:
    """Why no broker can be cut off on this machine (None: one can)."""
    if os.geteuid() != 0:
        return "cutting a broker off takes root (iptables)"
    for tool in ("iptables", "ss"):
        if shutil.which(tool) is None:
            return f"cutting a broker off takes {tool}, which is not installed"
    if _cgroup2() is None:
        return "cutting a broker off takes a writable cgroup v2 hierarchy (none is mounted)"
    listed = subprocess.run(
        ["iptables", "-S", "OUTPUT"], check=False, capture_output=True, text=True
    )
    if listed.returncode != 0:
        return f"iptables does not work here: {listed.stderr.strip()}"
    return None


@contextlib.contextmanager
def cut_off(pid: int, ports: Sequence[int]) -> Iterator[None]:
    """The broker process ``pid`` off the loopback network while the block runs.

    TCP to and from its ``ports`` (its client and controller listeners) is dropped, on INPUT
    and OUTPUT of lo, by --dport and --sport: nothing reaches it. That alone leaves it
    reaching the others (its connections to their ports come from ports of its own): it
    would go on fetching as a follower and heart-beating to the controller, stay in every
    in-sync set and unfenced, and only the partitions it leads would stall. So every packet
    its own sockets send is dropped too: the process moves into a cgroup of its own, matched
    on OUTPUT, and the connections it opened before the move are closed (``ss -K``); its new
    ones are born in that cgroup.

    Each rule carries a comment of this cut's own, and exactly the rules added are removed
    when the block ends, however it ends; the process then goes back to its cgroup."""
    tag = f"kvledger-test-cut-{uuid.uuid4().hex[:8]}"
    root = _cgroup2()
    assert root is not None, cut_unavailable()
    home, group = _cgroup_of(pid), root / tag
    added: list[list[str]] = []
    try:
        group.mkdir()
        for rule in _drop_rules(ports, tag):
            _iptables("-A", rule)
            added.append(rule)
        (group / "cgroup.procs").write_text(str(pid))
        _close_outgoing(pid, ports)
        yield
    finally:
        _remove_rules(added)
        if group.exists():
            with contextlib.suppress(ProcessLookupError):  # a node that died meanwhile
                (root / home / "cgroup.procs").write_text(str(pid))
            group.rmdir()


def _drop_rules(ports: Sequence[int], tag: str) -> list[list[str]]:
    rules = [
        [chain, "-i" if chain == "INPUT" else "-o", "lo", "-p", "tcp", way, str(port)]
        for port in ports
        for chain in ("INPUT", "OUTPUT")
        for way in ("--dport", "--sport")
    ]
    rules.append(["OUTPUT", "-o", "lo", "-m", "cgroup", "--path", tag])
    return [[*rule, "-m", "comment", "--comment", tag, "-j", "DROP"] for rule in rules]


def _iptables(action: str, rule: list[str]) -> None:
    subprocess.run(["iptables", "-w", action, *rule], check=True, capture_output=True, text=True)


def _remove_rules(added: list[list[str]]) -> None:
    """Delete each rule added (every one is tried); the first failure is raised after."""
    failed: list[subprocess.CalledProcessError] = []
    for rule in reversed(added):
        try:
            _iptables("-D", rule)
        except subprocess.CalledProcessError as exc:
            failed.append(exc)
    if failed:
        raise AssertionError(f"iptables -D failed: {failed[0].stderr}") from failed[0]


def _cgroup2() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, writable (None: nowhere)."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, kind, *_ = line.split()
        if kind == "cgroup2" and os.access(where, os.W_OK):
            return Path(where)
    return None


def _cgroup_of(pid: int) -> str:
    """The process's cgroup v2 path, relative to the hierarchy's root."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:].lstrip("/")
    raise AssertionError(f"process {pid} has no cgroup v2 path")


def _outgoing(pid: int, ports: Sequence[int]) -> list[tuple[int, int]]:
    """(local port, peer port) of each established connection the process opened itself."""
    listed = subprocess.run(
        ["ss", "-tnpH", "state", "established"], check=True, capture_output=True, text=True
    ).stdout
    out = []
    for line in listed.splitlines():
        if f"pid={pid}," in line:
            local, peer = (int(end.rsplit(":", 1)[1]) for end in line.split()[2:4])
            if local not in ports:  # not one accepted on its listeners: those are cut
                out.append((local, peer))
    return out


def _close_outgoing(pid: int, ports: Sequence[int]) -> None:
    for local, peer in _outgoing(pid, ports):
        match = f"sport = :{local} and dport = :{peer}"
        subprocess.run(["ss", "-K", "-tn", match], check=True, capture_output=True)
    left = _outgoing(pid, ports)
    assert not left, f"ss -K did not close {left} (a kernel without INET_DIAG_DESTROY?)"


class AckWatch:
    """A producer (acks=all, idempotent) of numbered records that keeps what became of those
    of the current round, and what the brokers answered them (its client's debug log)."""

    def __init__(self, bootstrap: str) -> None:
        self.said: list[str] = []
        log = logging.getLogger(f"{__name__}.ackwatch-{uuid.uuid4().hex[:8]}")
        log.addHandler(_Kept(self.said))
        log.setLevel(logging.DEBUG)
        log.propagate = False
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "acks": "all",
                "enable.idempotence": True,
                "message.timeout.ms": 300_000,  # longer than any cut
                "debug": "msg",
                "logger": log,
            }
        )
        self.delivered: list[KafkaError | None] = []
        self.written = 0

    def produce(self, topic: str, count: int) -> None:
        """A new round: ``count`` records, numbered on from the last round's."""
        self.said.clear()
        self.delivered = []
        for _ in range(count):
            value = str(self.written).encode()
            self.producer.produce(topic, value, key=value, on_delivery=self._done)
            self.written += 1
        self.producer.poll(0)

    def _done(self, err: KafkaError | None, _: Message) -> None:
        self.delivered.append(err)

    def refused_and_retried(self) -> bool:
        """A broker answered the round NOT_ENOUGH_REPLICAS and the client retries."""
        self.producer.poll(0)  # serves the client's log and its delivery reports
        return any("Not enough in-sync replicas (actions Retry" in line for line in self.said)

    def pending(self) -> int:
        self.producer.poll(0)
        return len(self.producer)

    def flush(self, timeout: float) -> list[KafkaError | None]:
        """Wait for the round's reports; what each said (None: delivered)."""
        assert self.producer.flush(timeout) == 0, f"{len(self.producer)} still pending"
        return self.delivered


class _Kept(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


# ---------------------------------------------------------------- a relayed engine
def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode()``: over UTF-16 code units, a signed 32-bit int."""
    units = text.encode("utf-16-be")
    h = 0
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def transaction_state_partition(transactional_id: str, partitions: int) -> int:
    """The partition of ``__transaction_state`` that holds ``transactional_id``: Kafka's
    ``TransactionStateManager.partitionFor``, ``Utils.abs(id.hashCode()) % partitions``.
    ``Utils.abs`` is Math.abs with Integer.MIN_VALUE taken as 0 (not ``h & 0x7fffffff``,
    which is ``Utils.toPositive``: another partition for every negative hash)."""
    h = java_string_hash(transactional_id)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


class SteadyEngine:
    """A scripted vLLM engine publishing one batch every ``interval`` seconds, on a thread
    of its own, until :meth:`stop`; it counts the batches (the engine numbers them from 0)."""

    def __init__(self, engine: Engine, interval: float = 0.05, seed: int = 11) -> None:
        self.engine, self.interval = engine, interval
        self.sent = 0
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        chains = range(len(TOKENS))
        while not self._stop.wait(self.interval):
            before = list(self.engine.held)
            self.engine.work(self._rng, 1, chains)  # one batch, or none (nothing to change)
            self.sent += self.engine.held != before

    def stop(self) -> int:
        """Stop publishing; the batches published."""
        self._stop.set()
        self._thread.join(10)
        return self.sent


@dataclass
class RelayedEngine:
    """A steady engine and kvledger's relay carrying it into the cluster."""

    engine: Engine
    steady: SteadyEngine
    relay: Relay

    @property
    def source(self) -> str:
        return self.relay.ranks[0].source

    @property
    def transactional_id(self) -> str:
        transactional_id = self.relay.ranks[0].txn.pub.config.transactional_id
        assert transactional_id is not None
        return transactional_id

    def in_transaction(self) -> bool:
        """An engine batch is in the relay's open transaction."""
        txn = self.relay.ranks[0].txn
        return txn.open and txn.in_txn > 0

    def metric(self, name: str) -> float:
        value = self.relay.metrics.registry.get_sample_value(name, {"source": self.source})
        assert value is not None, name
        return value

    def truth(self) -> dict[tuple[int, bytes, str, str], int]:
        """What the engine holds, as the index keys a residency (group, hash, medium,
        ownership) with its reference count."""
        held = self.engine.held
        return {
            (0, hash_bytes(block_hash(c, j)), "GPU", ""): 1
            for c in range(len(held))
            for j in range(held[c])
        }


def relayed_batches(bootstrap: str, topic: str, source: str, group: int = 0) -> list[int | None]:
    """The engine batch of each committed message of ``source``'s group on ``topic``, in the
    log's order (None: a message of no batch: an announcement, a heartbeat)."""
    key = message_key(source, group)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"t-relayed-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    codec, out = Codec(), list[int | None]()
    try:
        partitions = len(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        at = partition_for(key, partitions)
        consumer.assign([TopicPartition(topic, at, OFFSET_BEGINNING)])
        while (msg := consumer.poll(30)) is not None:
            err = msg.error()
            if err is not None and err.code() == KafkaError._PARTITION_EOF:
                return out
            if err is not None:
                raise KafkaException(err)
            if msg.key() == key:
                out.append(codec.decode(msg.value() or b"").engine_seq)
        raise AssertionError(f"reading {topic}[{at}] stalled after {len(out)} messages")
    finally:
        consumer.close()
