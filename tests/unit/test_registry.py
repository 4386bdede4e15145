"""Schema Registry framing as the ecosystem expects it: subjects by topic name (or the other
strategies), writers register, readers never do. Registry calls go to confluent-kafka's own
in-process registry (``mock://``), which this library ships for such tests; no registry
server can run on this machine (see docs/operations.md), so there is no test against one."""

from __future__ import annotations

import argparse
import struct

import pytest

from kvledger import settings
from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import KvledgerError
from kvledger.schemas.events import Envelope, Heartbeat
from kvledger.schemas.registry import RegistryUnavailableError, subject_for
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
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RegistryUnavailableError, match="did not answer"):
        settings.codec(_args(url), "t", writer=True)
