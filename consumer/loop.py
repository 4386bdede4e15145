"""One loop reads the log, whatever it feeds: the index consumer and the decision recorder
(PostgreSQL), the router index and the decision log (memory) run the same :class:`LogLoop`
and differ only in their :class:`Sink` (arroyo's ``StreamProcessor`` and its strategies).

Each turn the loop reads what the client gives (:data:`Read`: :func:`filled` batches, each
a PostgreSQL transaction; :func:`prompt`, what has arrived, at once), sorts it
(:func:`triage`: messages in log order; partitions whose position fell out of the log; a
fatal client error; a broker's refusal, raised at once), and hands it to the sink: the
messages to :meth:`Sink.apply`, the positions out of range to :meth:`Sink.lost`, then
:meth:`Sink.turned` ends the turn (and may end the loop). A fatal client error makes the
client's owner start a new client (:meth:`Client.renew`): every sink resumes from the
positions it keeps, so nothing is lost or applied twice.

How a sink commits is its own (:class:`Commit`, :func:`commit_of`): a
:class:`TransactionSink` writes each batch and its next offsets in one PostgreSQL
transaction (the client starts from those), and the loop passes what it committed on to
Kafka only as a hint for lag tools (auto-commit is off); any other sink keeps its positions
in memory, and nothing is committed anywhere. Every reader's client is made by
:func:`kafka_consumer`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kvledger.consumer.inbound import Inbound, from_kafka
from kvledger.schemas.errors import NotAuthorizedError
from kvledger.schemas.kafka_log import client_logging
from kvledger.schemas.topics import refused

logger = logging.getLogger(__name__)

# How a loop reads one turn's worth from its client.
Read = Callable[[Consumer], list[Message]]


def kafka_consumer(settings: Mapping[str, Any]) -> Consumer:
    """Every log reader's Kafka client (the relay's bounded position read aside): the
    reader's ``settings`` (servers, its group id, its own and the operator's settings, in
    the precedence it chooses) over the defaults every reader shares: auto-commit off and
    no offset stored by the client (each reader keeps its own positions: in PostgreSQL's
    transaction or in memory), librdkafka's log lines through logging
    (:func:`~kvledger.schemas.kafka_log.client_logging`)."""
    return Consumer(
        client_logging({"enable.auto.commit": False, "enable.auto.offset.store": False, **settings})
    )


def take(consumer: Consumer, limit: int, timeout: float) -> list[Message]:
    """Up to ``limit`` messages (and error events), waiting at most ``timeout`` seconds for
    the first: at once what the client holds, else the first to arrive and the rest the
    client holds by then.

    ``Consumer.consume(n, timeout)`` returns when ``n`` messages have arrived or ``timeout``
    has passed: on a light stream every message waited out the whole timeout (0.2 s) before
    the router applied it. The consumer's own loop keeps filling its batches (each is a
    PostgreSQL transaction: side by side under a steady 3,000 msg/s its lag looked no better
    taking promptly, and the runs were too noisy to say it was not worse)."""
    messages = consumer.consume(limit, timeout=0)
    if messages:
        return messages
    first = consumer.poll(timeout)
    if first is None:
        return []
    return [first, *consumer.consume(limit - 1, timeout=0)] if limit > 1 else [first]


@dataclass(slots=True)
class Polled:
    """One turn's read, sorted."""

    received: int  # what the client gave, error events included
    batch: list[Inbound] = field(default_factory=list)  # the messages, in log order
    reset: set[int] = field(default_factory=set)  # partitions whose position left the log
    fatal: KafkaError | None = None  # the client cannot go on


def triage(
    messages: Sequence[Message],
    topic: str,
    reader: str,
    stop_at: Mapping[int, int] | None = None,
    needs: str = "",
) -> Polled:
    """Sort what the client gave. A refusal by the broker raises
    :class:`NotAuthorizedError` (no retry changes who we are or what we may do); other
    errors are logged (the client retries them itself). ``stop_at``: per partition, the
    first offset not to apply (a bounded run). ``needs``: the rights the reader needs
    beyond reading the topic, named in a refusal."""
    polled = Polled(len(messages))
    for m in messages:
        err = m.error()
        if err is None:
            message = from_kafka(m)
            if stop_at is None or message.offset < stop_at.get(message.partition, 0):
                polled.batch.append(message)
        elif err.code() == KafkaError._AUTO_OFFSET_RESET:
            where = m.partition()
            if where is not None and where >= 0:
                polled.reset.add(where)
        elif refused(err):
            raise NotAuthorizedError(
                f"the broker refused {reader} ({err.name()}: {err.str()}): it needs READ and "
                f"DESCRIBE on topic {topic!r}{needs}"
            )
        elif err.fatal() or err.code() == KafkaError._FATAL:
            polled.fatal = err
        elif err.code() != KafkaError._PARTITION_EOF:
            logger.warning("%s: %s", reader, err)
    return polled


class Client(Protocol):
    """Who owns the loop's Kafka client."""

    @property
    def client(self) -> Consumer: ...

    def renew(self) -> None:
        """Close the client after a fatal error and start another where the sink stands."""


class Sink(Protocol):
    """What a loop feeds. Its positions in the log live in memory (the router's store, the
    decision log's client) unless it is a :class:`TransactionSink`."""

    def apply(self, batch: list[Inbound]) -> None:
        """Apply messages read, in log order, exactly once."""

    def lost(self, partitions: set[int]) -> None:
        """The client's position in these partitions fell out of the log's range (records
        deleted before they were read, or a topic made again). Raise :class:`StopLoop` to
        end the loop."""

    def turned(self, client: Consumer, polled: Polled) -> bool:
        """The turn is over (everything read is applied): True ends the loop."""


@runtime_checkable
class TransactionSink(Sink, Protocol):
    """A sink whose positions live in PostgreSQL: each batch is written with its next
    offsets in one transaction, and its client starts from the offsets stored there, so a
    crash at any instant neither loses nor applies twice. Kafka holds only a hint."""

    def committed(self) -> dict[tuple[str, int], int]:
        """The next offsets, per (topic, partition), of the batches committed since the
        last call (the loop commits them to Kafka as a hint; nothing reads them back)."""


class Commit(Enum):
    """Where a sink's positions in the log live: what the loop commits for it."""

    TRANSACTION = "offsets in PostgreSQL's transaction; Kafka gets a hint"
    MEMORY = "positions in memory; nothing committed"


def commit_of(sink: Sink) -> Commit:
    """How ``sink`` commits: a :class:`TransactionSink` in PostgreSQL's transaction, any
    other in memory."""
    return Commit.TRANSACTION if isinstance(sink, TransactionSink) else Commit.MEMORY


class StopLoop(Exception):  # noqa: N818 - a request, not an error
    """Raised by a sink to end its loop (the sink has said why)."""


def filled(limit: int, timeout: float) -> Read:
    """Read batches filled to ``limit`` messages or ``timeout`` seconds: each is one
    PostgreSQL transaction, so a busy topic's stay large (the index consumer, the
    recorder)."""
    return lambda client: client.consume(limit, timeout=timeout)


def prompt(limit: int, timeout: float) -> Read:
    """Read what has arrived, at once (:func:`take`): a reader whose lookups wait for each
    message (the router index, the decision log)."""
    return lambda client: take(client, limit, timeout)


class LogLoop:
    """Reads one topic with one client and feeds a sink, until ``stop`` is set or the sink
    ends it (see the module docstring); :attr:`commit` says how the sink commits.

    ``reader`` names it in logs and errors; ``stop_at``: per partition, the first offset not
    to apply (a bounded run); ``needs``: the rights it needs beyond reading the topic, named
    in a broker's refusal."""

    def __init__(  # noqa: PLR0913 - a reader's parts: topic, name, client, read, sink, stop, bounds
        self,
        topic: str,
        reader: str,
        owner: Client,
        read: Read,
        sink: Sink,
        stop: threading.Event,
        stop_at: Mapping[int, int] | None = None,
        needs: str = "",
    ) -> None:
        self.topic, self.reader, self.owner, self.read = topic, reader, owner, read
        self.sink, self.stop, self.stop_at, self.needs = sink, stop, stop_at, needs
        self.commit = commit_of(sink)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.turn():
                    return
        except StopLoop:
            return

    def turn(self, read: Read | None = None) -> bool:
        """One read (the loop's own, or ``read``), applied and committed; True when the
        loop is done."""
        client = self.owner.client
        messages = (read or self.read)(client)
        polled = triage(messages, self.topic, self.reader, self.stop_at, self.needs)
        if polled.fatal is not None:
            # The client cannot go on (e.g. a static member fenced after a broker restart).
            # The positions live with the sink: a new client resumes exactly.
            logger.error(
                "%s: fatal client error, starting a new client: %s", self.reader, polled.fatal
            )
            self.owner.renew()
            return False
        if polled.batch:
            self.sink.apply(polled.batch)
        if polled.reset:
            self.sink.lost(polled.reset)
        done = self.sink.turned(client, polled)
        self.hint(client)
        return done

    def hint(self, client: Consumer | None = None) -> None:
        """A :class:`TransactionSink`'s offsets committed since the last hint, committed to
        Kafka for lag tools (asynchronously; a failure is only logged)."""
        if not isinstance(self.sink, TransactionSink):
            return
        committed = self.sink.committed()
        if not committed:
            return
        offsets = [TopicPartition(t, p, n) for (t, p), n in committed.items()]
        try:
            (client or self.owner.client).commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:  # a hint only
            logger.debug("%s: offset hint not committed: %s", self.reader, exc)
