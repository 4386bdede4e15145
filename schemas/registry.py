"""Confluent Schema Registry: subjects named as the ecosystem names them, and the client.

Subjects follow the serializers' strategies: ``topic`` (TopicNameStrategy, the default:
``<topic>-value``), ``record`` (RecordNameStrategy: the record's full name,
``kvledger.Envelope``) and ``topic_record`` (TopicRecordNameStrategy:
``<topic>-kvledger.Envelope``). Writers register the envelope schema under their subject
after checking it is compatible with what is there; readers never register: they resolve a
message's writer schema by the id in its framing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from kvledger.schemas.errors import KvledgerError

SubjectStrategy = Literal["topic", "record", "topic_record"]
STRATEGIES: tuple[SubjectStrategy, ...] = get_args(SubjectStrategy)
RECORD_NAME = "kvledger.Envelope"


class SchemaIncompatibleError(KvledgerError):
    """The registry's compatibility rule refuses this schema under the subject."""


class RegistryUnavailableError(KvledgerError):
    """The registry did not answer, or refused the request for another reason."""


def subject_for(topic: str, strategy: str = "topic") -> str:
    """The subject of the topic's value schema under ``strategy``."""
    if strategy == "topic":
        return f"{topic}-value"
    if strategy == "record":
        return RECORD_NAME
    if strategy == "topic_record":
        return f"{topic}-{RECORD_NAME}"
    raise ValueError(f"subject strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")


def open_registry(url: str, settings: Mapping[str, str] | None = None) -> Any:
    """A client of the registry at ``url``; ``settings`` are the client's own (e.g.
    ``basic.auth.user.info``, ``ssl.ca.location``). Needs the ``registry`` extra."""
    try:
        from confluent_kafka.schema_registry import SchemaRegistryClient
    except ImportError as exc:  # the registry extra is not installed
        raise ModuleNotFoundError(
            "the schema registry client needs: pip install 'kvledger[registry]'", name="authlib"
        ) from exc
    return SchemaRegistryClient.new_client({**dict(settings or {}), "url": url})
