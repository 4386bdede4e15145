"""Codecs for tests that hold the compiled decoder to one answer with the tests' oracle."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvledger.schemas.codec import Codec
from kvledger.schemas.errors import DecodeError
from tests.helpers.avro_strict import Check, MalformedAvroError, compile_check


@contextmanager
def _pure() -> Iterator[None]:
    """KVLEDGER_PURE_AVRO=1 inside, the variable as it was afterwards."""
    saved = os.environ.get("KVLEDGER_PURE_AVRO")
    os.environ["KVLEDGER_PURE_AVRO"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["KVLEDGER_PURE_AVRO"]
        else:
            os.environ["KVLEDGER_PURE_AVRO"] = saved


def pure_codec(**options: Any) -> Codec:
    """A codec as an install without the compiled core has it: fastavro alone."""
    with _pure():
        return Codec(**options)


class OracleCodec(Codec):
    """The oracle for the core's strict decoding: fastavro alone (as :func:`pure_codec`),
    after tests/helpers/avro_strict.py's check of the writer schema, the core's refusals
    restated in Python. Takes :class:`Codec`'s options."""

    def __init__(self, **options: Any) -> None:
        with _pure():
            super().__init__(**options)
        self._oracle: dict[int, Check] = {}

    def _fastavro(self, data: bytes, writer: Any, header_len: int) -> dict[str, Any]:
        check = self._oracle.get(id(writer))
        if check is None:
            check = self._oracle[id(writer)] = compile_check(_plain(writer))
        try:
            check(data, header_len)
        except MalformedAvroError as exc:
            raise DecodeError("undecodable", f"Avro body does not decode: {exc}") from None
        except RecursionError:
            raise DecodeError("undecodable", "Avro body nested too deeply") from None
        return super()._fastavro(data, writer, header_len)


def _plain(parsed: Any) -> Any:
    """A schema as fastavro parsed it, its own keys ("__fsp", ...) dropped."""
    if isinstance(parsed, dict):
        return {k: _plain(v) for k, v in parsed.items() if not k.startswith("__")}
    if isinstance(parsed, list):
        return [_plain(v) for v in parsed]
    return parsed
