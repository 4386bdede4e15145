"""Errors the producer library raises to the engine integration."""

from __future__ import annotations

from kvledger.schemas.errors import KvledgerError, TopicMismatchError

__all__ = [
    "BrokerUnreachableError",
    "DeliveryError",
    "FatalProducerError",
    "MessageTooLargeError",
    "PublishError",
    "QueueFullError",
    "TopicMismatchError",
]


class PublishError(KvledgerError):
    """Events could not be delivered; nothing is dropped quietly."""


class DeliveryError(PublishError):
    """The broker refused or never acknowledged some messages (see ``errors``)."""

    def __init__(self, message: str, errors: list[str]) -> None:
        super().__init__(message)
        self.errors = errors


class FatalProducerError(PublishError):
    """The Kafka client hit a fatal error (e.g. idempotence fenced): the publisher is dead."""


class BrokerUnreachableError(PublishError):
    """No broker answered within the publisher's start-up bound."""


class MessageTooLargeError(PublishError):
    """Some events were larger than the topic takes; they were not produced (and took no
    sequence number), every other event of the call was. ``refused``: what and how big."""

    def __init__(self, message: str, refused: list[str]) -> None:
        super().__init__(message)
        self.refused = refused


class QueueFullError(PublishError):
    """A batch was not taken: the writer's queue stayed full past the caller's bound (the
    batch is not published; nothing after it is affected)."""
