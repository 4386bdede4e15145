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
    """The registry did not answer, or refused the request for another reason. Retryable:
    no message is at fault (a reader waits for the registry, a writer is refused)."""


# The client's settings that are numbers (a properties file gives strings), and the request
# timeout kvledger gives it when none is set: the client's own is none at all, so a registry
# that accepts connections and never answers would hold a reader without a word.
NUMERIC_SETTINGS = frozenset(
    {"timeout", "max.retries", "retries.wait.ms", "retries.max.wait.ms", "cache.capacity",
     "cache.latest.ttl.sec"}
)  # fmt: skip
DEFAULT_TIMEOUT_S = 10


def not_found(exc: Any) -> bool:
    """Whether a registry's error (``SchemaRegistryError``) says it does not hold what was
    asked: HTTP 404 with one of a registry's 404xx codes. A 404 without one is no registry's
    answer (the URL names something else)."""
    code = getattr(exc, "error_code", None)
    return (
        getattr(exc, "http_status_code", None) == 404
        and isinstance(code, int)
        and (40400 <= code < 40500)
    )


def refusal(exc: Any) -> str:
    """A registry's error in words, with what to check where the URL looks wrong."""
    if getattr(exc, "http_status_code", None) == 404 and not not_found(exc):
        return (
            f"{exc}: a 404 without a registry's error code: is the URL the registry's "
            "Confluent API (Apicurio's is /apis/ccompat/v7)?"
        )
    return str(exc)


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
    ``basic.auth.user.info``, ``ssl.ca.location``; ``timeout``, 10 s by default, for each
    request). Needs the ``registry`` extra."""
    try:
        from confluent_kafka.schema_registry import SchemaRegistryClient
    except ImportError as exc:  # the registry extra is not installed
        raise ModuleNotFoundError(
            "the schema registry client needs: pip install 'kvledger[registry]'", name="authlib"
        ) from exc
    conf: dict[str, Any] = {"timeout": DEFAULT_TIMEOUT_S}
    for key, value in (settings or {}).items():
        conf[key] = _number(key, value) if key in NUMERIC_SETTINGS else value
    return SchemaRegistryClient.new_client({**conf, "url": url})


def _number(key: str, value: Any) -> int | float:
    try:
        return int(value) if str(value).strip().isdigit() else float(value)
    except ValueError:
        raise ValueError(f"schema registry setting {key}: a number, not {value!r}") from None
