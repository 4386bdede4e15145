"""consumer/loop.py's one loop under each reader: the four Kafka readers of the project (the
index consumer, the decision recorder, the router index's tail, the decision log) each run
a :class:`LogLoop`, each as the sink it declares (offsets in PostgreSQL's transaction, or
positions in memory), and make their clients in one place. What the loop commits for each
kind of sink is checked without services."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

from confluent_kafka import Consumer, Message, TopicPartition

from kvledger.consumer.config import ConsumerConfig
from kvledger.consumer.decision_records import DecisionRecorder
from kvledger.consumer.inbound import Inbound
from kvledger.consumer.loop import Commit, LogLoop, Polled, TransactionSink, commit_of
from kvledger.consumer.service import IndexConsumer
from kvledger.serving.router.decisions import DecisionLog
from kvledger.serving.router.index import RouterIndex
from kvledger.serving.router.provisional import Provisional
from kvledger.serving.router.tail import TailSink

ROOT = Path(__file__).resolve().parents[2]


def msg(partition: int, offset: int) -> Message:
    return Message(topic="t", partition=partition, offset=offset, key=b"k", value=b"v")


class Committing:
    """The part of a Kafka client the loop commits through, recording each commit."""

    def __init__(self) -> None:
        self.commits: list[list[tuple[str, int, int]]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        assert asynchronous  # a hint never waits
        self.commits.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])


class Sink:
    """A client owner and a sink that keeps its positions in memory."""

    def __init__(self, turns: list[list[Message]]) -> None:
        self.turns = turns
        self.committing = Committing()
        self.applied: list[int] = []

    @property
    def client(self) -> Consumer:
        return self.committing  # type: ignore[return-value]  # what the loop commits through

    def renew(self) -> None:
        raise AssertionError("no fatal error here")

    def read(self, _client: Consumer) -> list[Message]:
        return self.turns.pop(0) if self.turns else []

    def apply(self, batch: list[Inbound]) -> None:
        self.applied += [m.offset for m in batch]

    def lost(self, partitions: set[int]) -> None:
        raise AssertionError("nothing lost here")

    def turned(self, _client: Consumer, polled: Polled) -> bool:
        return not self.turns


class Transaction(Sink):
    """A sink that writes each batch with its next offsets in one transaction."""

    def __init__(self, turns: list[list[Message]]) -> None:
        super().__init__(turns)
        self.pending: dict[tuple[str, int], int] = {}

    def apply(self, batch: list[Inbound]) -> None:
        super().apply(batch)
        if batch[0].offset == 13:  # a batch whose transaction did not commit: no offsets
            return
        self.pending.update({(m.topic, m.partition): m.offset + 1 for m in batch})

    def committed(self) -> dict[tuple[str, int], int]:
        pending, self.pending = self.pending, {}
        return pending


def run(sink: Sink) -> LogLoop:
    loop = LogLoop("t", "a reader", sink, sink.read, sink, threading.Event())
    loop.run()
    return loop


def test_a_transaction_sink_has_its_committed_offsets_hinted_to_kafka_after_each_turn() -> None:
    sink = Transaction([[msg(0, 1), msg(1, 7), msg(0, 2)], [], [msg(0, 13)], [msg(1, 8)]])
    loop = run(sink)
    assert loop.commit is Commit.TRANSACTION and isinstance(sink, TransactionSink)
    assert sink.applied == [1, 7, 2, 13, 8]
    # Once per turn that committed something, the offsets it committed, nothing else.
    assert sink.committing.commits == [[("t", 0, 3), ("t", 1, 8)], [("t", 1, 9)]]
    loop.hint()  # nothing committed since: nothing hinted
    assert len(sink.committing.commits) == 2


def test_a_memory_sink_has_nothing_committed() -> None:
    sink = Sink([[msg(0, 1)], [msg(0, 2)]])
    loop = run(sink)
    assert loop.commit is Commit.MEMORY and commit_of(sink) is Commit.MEMORY
    assert sink.applied == [1, 2] and sink.committing.commits == []


def test_every_reader_runs_on_the_one_loop_as_the_sink_it_declares() -> None:
    """Nothing here connects: a loop reaches its client only when it turns."""
    consumer = IndexConsumer(ConsumerConfig("127.0.0.1:9", "postgresql://nowhere/x"))
    recorder = DecisionRecorder("postgresql://nowhere/x", "127.0.0.1:9", "decisions", "g")
    router = RouterIndex("127.0.0.1:9", "t", "g")
    log = DecisionLog("127.0.0.1:9", "decisions", Provisional(5.0))
    loops = {
        "index consumer": (consumer.loop(), consumer, Commit.TRANSACTION),
        "decision recorder": (recorder.loop(), recorder, Commit.TRANSACTION),
        "router index": (router.loop(), None, Commit.MEMORY),
        "decision log": (log.loop(), log, Commit.MEMORY),
    }
    for name, (loop, sink, commit) in loops.items():
        assert type(loop) is LogLoop, name
        assert loop.commit is commit, name
        if sink is not None:
            assert loop.sink is sink and loop.owner is sink, name
    router_loop = loops["router index"][0]
    assert isinstance(router_loop.sink, TailSink) and router_loop.sink.index is router


def test_every_reader_makes_its_kafka_client_in_one_place() -> None:
    """``confluent_kafka.Consumer`` is called in consumer/loop.py's ``kafka_consumer`` only
    (the relay's bounded position read, in producer/relay, keeps its own)."""
    made = []
    for folder in ("consumer", "serving", "schemas", "kvledger"):
        for path in sorted((ROOT / folder).glob("**/*.py")):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if p != ROOT):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id == "Consumer")
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "Consumer")
                ):
                    made.append(str(path.relative_to(ROOT)))
    assert made == ["consumer/loop.py"]
