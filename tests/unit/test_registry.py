"""Schema Registry framing as the ecosystem expects it: subjects by topic name (or the other
strategies), writers register, readers never do. Registry calls go to confluent-kafka's own
in-process registry (``mock://``), which this library ships for such tests, or to no
registry at all; tests/test_schema_registry.py runs against a real one (Apicurio)."""

from __future__ import annotations

import argparse
import struct

import pytest

from kvledger import settings
from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.events import Envelope, Heartbeat
from kvledger.schemas.registry import (
    RegistryUnavailableError,
    not_found,
    open_registry,
    refusal,
    subject_for,
)
from tests.helpers.procs import free_port


def test_subjects_by_strategy() -> None:
    assert subject_for("kv-events") == "kv-events-value"  # TopicNameStrategy
    assert subject_for("kv-events", "record") == "kvledger.Envelope"
    assert subject_for("kv-events", "topic_record") == "kv-events-kvledger.Envelope"
    with pytest.raises(ValueError, match="subject strategy"):
        subject_for("kv-events", "by_mood")


def _args(url: str, strategy: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        schema_registry=url, schema_registry_config=None, subject_strategy=strategy
    )


def test_writers_register_under_the_topic_subject_and_readers_never_register() -> None:
    url = "mock://kvledger-registry-strategies"
    writer = settings.codec(_args(url), "fleet-a", writer=True)
    assert writer is not None and writer.registry is not None
    registry = writer.registry  # the in-process registry lives in this client
    assert registry.get_subjects() == ["fleet-a-value"]
    env = Envelope("e0", "m", 0, 1, 0, 1_700_000_000_000, Heartbeat(0, 5000))
    data = writer.encode(env)
    assert data[:1] == b"\x00"
    schema_id = struct.unpack_from(">I", data, 1)[0]
    reader = Codec(registry=registry)  # what settings.codec(..., writer=False) builds
    assert reader.decode(data) == env
    assert registry.get_subjects() == ["fleet-a-value"]  # the reader registered nothing
    assert registry.get_schema(schema_id).schema_type == "AVRO"
    assert settings.codec(_args(url), "fleet-a", writer=False) is not None
    record = settings.codec(_args(url, "record"), "fleet-b", writer=True)
    assert record is not None and record.registry is not None
    assert record.registry.get_subjects() == ["kvledger.Envelope"]
    # A reader without a registry still reads the default framing, and not the registry's.
    plain = Codec()
    assert plain.decode(Codec().encode(env)) == env
    with pytest.raises(KvledgerError):
        plain.decode(data)


def test_no_registry_flag_keeps_the_default_framing() -> None:
    assert settings.codec(_args(""), "t", writer=True) is None


def test_an_unreachable_registry_is_a_clear_error() -> None:
    """A writer is refused, naming the registry (not its password) and where it was set."""
    port = free_port()  # nothing listens there
    with pytest.raises(RegistryUnavailableError, match="did not answer") as info:
        settings.codec(_args(f"http://reader:secret@127.0.0.1:{port}/api"), "t", writer=True)
    said = str(info.value)
    assert f"at http://127.0.0.1:{port}/api: check --schema-registry" in said, said
    assert "secret" not in said


def _framed(schema_id: int = 1) -> bytes:
    """A heartbeat in the registry's framing, written with schema id ``schema_id``."""
    body = Codec().encode(Envelope("e0", "m", 0, 1, 0, 1_700_000_000_000, Heartbeat(0, 5000)))
    return b"\x00" + struct.pack(">I", schema_id) + body[10:]


def test_a_reader_whose_registry_is_away_waits_instead_of_rejecting() -> None:
    """No registry answers: the message is not at fault, so decoding raises the registry's
    failure (the consumer retries the batch), not a DecodeError (which would dead-letter
    it). The settings of a properties file are strings; the numbers among them are made
    numbers."""
    url = f"http://127.0.0.1:{free_port()}"
    reader = Codec(registry=open_registry(url, {"max.retries": "0", "timeout": "2.5"}))
    with pytest.raises(RegistryUnavailableError, match="did not answer for schema id 7"):
        reader.decode(_framed(7))
    with pytest.raises(ValueError, match=r"max\.retries: a number"):
        open_registry(url, {"max.retries": "three"})


def test_a_registry_that_never_answers_is_given_up_on_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registry that takes the connection and says nothing: the client's own timeout is
    none at all (the consumer would hang without a word); kvledger gives it one (10 s,
    1 s here), which a setting can change."""
    import socket
    import time

    from kvledger.schemas import registry

    assert registry.DEFAULT_TIMEOUT_S == 10
    monkeypatch.setattr(registry, "DEFAULT_TIMEOUT_S", 1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for settings_ in ({"max.retries": "0"}, {"max.retries": "0", "timeout": "0.5"}):
            began = time.monotonic()
            with pytest.raises(RegistryUnavailableError, match="did not answer"):
                Codec(registry=open_registry(url, settings_)).decode(_framed())
            assert time.monotonic() - began < 5


def test_what_a_registry_error_says() -> None:
    """Its own 404xx: it does not hold the id (the message's fault). A 404 without one: the
    URL names no registry's API, which is said."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    assert not_found(SchemaRegistryError(404, 40403, "Schema 7 not found."))
    assert not not_found(SchemaRegistryError(404, -1, "Unknown Schema Registry Error: b''"))
    assert not not_found(SchemaRegistryError(500, 50001, "Error in the backend data store"))
    assert "/apis/ccompat/v7" in refusal(SchemaRegistryError(404, None, None))


def test_writers_resolved_beforehand_leave_decoding_nothing_to_ask() -> None:
    """The router asks the registry for a chunk's writer schemas before it takes the
    lookups' lock: after resolve_writers, decoding asks the registry nothing; a message of
    the default framing, or one naming an id the registry lacks, is left to decode."""
    writer = settings.codec(_args("mock://kvledger-registry-resolve"), "fleet-r", writer=True)
    assert writer is not None and writer.registry is not None
    registry = writer.registry
    env = Envelope("e0", "m", 0, 1, 0, 1_700_000_000_000, Heartbeat(0, 5000))
    data = writer.encode(env)
    asked: list[int] = []

    class Counting:
        def register_schema(self, subject_name: str, schema: object) -> int:
            raise AssertionError("a reader registers nothing")

        def get_schema(self, schema_id: int) -> object:
            asked.append(schema_id)
            return registry.get_schema(schema_id)

    reader = Codec(registry=Counting())
    reader.resolve_writers([data, data, Codec().encode(env), _framed(schema_id=999_999)])
    assert asked == [struct.unpack_from(">I", data, 1)[0], 999_999]
    assert reader.decode(data) == env
    assert len(asked) == 2  # decoding asked nothing more
