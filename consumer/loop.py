"""One loop reads the log, whatever it feeds: the index consumer (PostgreSQL) and the router
index (memory) run the same :class:`LogLoop` and differ only in their :class:`Sink`.

Each turn the loop reads what the client gives (:data:`Read`: the consumer fills batches,
each a PostgreSQL transaction; the router :func:`take`\\ s promptly), sorts it
(:func:`triage`: messages in log order; partitions whose position fell out of the log; a
fatal client error; a broker's refusal, raised at once), and hands it to the sink: the
messages to :meth:`Sink.apply`, the positions out of range to :meth:`Sink.lost`, then
:meth:`Sink.turned` ends the turn (and may end the loop). A fatal client error makes the
client's owner start a new client (:meth:`Client.renew`): every sink resumes from the
offsets it stored, so nothing is lost or applied twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import Consumer, KafkaError, Message

from kvledger.consumer.inbound import Inbound, from_kafka
from kvledger.schemas.errors import NotAuthorizedError
from kvledger.schemas.topics import refused

logger = logging.getLogger(__name__)

# How a loop reads one turn's worth from its client.
Read = Callable[[Consumer], list[Message]]


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
    """What a loop feeds."""

    def apply(self, batch: list[Inbound]) -> None:
        """Apply messages read, in log order, exactly once."""

    def lost(self, partitions: set[int]) -> None:
        """The client's position in these partitions fell out of the log's range (records
        deleted before they were read, or a topic made again). Raise :class:`StopLoop` to
        end the loop."""

    def turned(self, client: Consumer, polled: Polled) -> bool:
        """The turn is over (everything read is applied): True ends the loop."""


class StopLoop(Exception):  # noqa: N818 - a request, not an error
    """Raised by a sink to end its loop (the sink has said why)."""


class LogLoop:
    """Reads one topic with one client and feeds a sink, until ``stop`` is set or the sink
    ends it (see the module docstring)."""

    def __init__(
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

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.turn():
                    return
        except StopLoop:
            return

    def turn(self) -> bool:
        """One read, applied; True when the loop is done."""
        client = self.owner.client
        polled = triage(self.read(client), self.topic, self.reader, self.stop_at, self.needs)
        if polled.fatal is not None:
            # The client cannot go on (e.g. a static member fenced after a broker restart).
            # The offsets live with the sink: a new client resumes exactly.
            logger.error("%s: fatal client error, starting a new client: %s", self.reader,
                         polled.fatal)  # fmt: skip
            self.owner.renew()
            return False
        if polled.batch:
            self.sink.apply(polled.batch)
        if polled.reset:
            self.sink.lost(polled.reset)
        return self.sink.turned(client, polled)
