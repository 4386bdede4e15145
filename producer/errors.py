"""Errors the producer library raises to the engine integration."""

from __future__ import annotations

from kvledger.schemas.errors import KvledgerError, TopicMismatchError

__all__ = ["DeliveryError", "FatalProducerError", "PublishError", "TopicMismatchError"]


class PublishError(KvledgerError):
    """Events could not be delivered; nothing is dropped quietly."""


class DeliveryError(PublishError):
    """The broker refused or never acknowledged some messages (see ``errors``)."""

    def __init__(self, message: str, errors: list[str]) -> None:
        super().__init__(message)
        self.errors = errors


class FatalProducerError(PublishError):
    """The Kafka client hit a fatal error (e.g. idempotence fenced): the publisher is dead."""
