"""kvledger's exception root. Every package raises subclasses of :class:`KvledgerError`."""

from __future__ import annotations


class KvledgerError(Exception):
    """Root of every error kvledger raises on purpose."""


class DecodeError(KvledgerError):
    """Bytes that are not a kvledger message this reader can decode.

    ``reason`` is a stable code: ``undecodable`` (garbage, truncated, wrong framing, trailing
    bytes) or ``unknown_schema`` (a well-framed message whose writer schema is not known).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TopicMismatchError(KvledgerError):
    """An existing topic does not have the shape kvledger was asked for."""


class NotAuthorizedError(KvledgerError):
    """The Kafka principal in use lacks a permission an operation needs (an ACL)."""
