"""Errors the producer library raises to the engine integration."""

from __future__ import annotations

from schemas.errors import KvledgerError


class PublishError(KvledgerError):
    """Events could not be delivered; nothing is dropped quietly."""


class DeliveryError(PublishError):
    """The broker refused or never acknowledged some messages (see ``errors``)."""

    def __init__(self, message: str, errors: list[str]) -> None:
        super().__init__(message)
        self.errors = errors


class FatalProducerError(PublishError):
    """The Kafka client hit a fatal error (e.g. idempotence fenced): the publisher is dead."""


class TopicMismatchError(KvledgerError):
    """An existing topic does not have the shape kvledger was asked for."""
