"""The compiled decoder's refusals restated in Python: the tests' oracle for the core's
strict reading (rust/src/wire.rs, rust/src/avro.rs). A walk of a writer schema over a
message's body that reads no value, only checks that the bytes are well formed as the core
requires. fastavro alone is lenient where the core refuses: it indexes a union with a
negative branch number (-1 on the envelope's event union picks its last branch), and reads
varints past 10 bytes or past 64 bits by dropping bits. tests/helpers/codecs.py's
:class:`OracleCodec` runs this check, then fastavro; tests/unit/test_decode_agreement.py
and the ``envelope`` fuzz target hold the product's codec to it on the same bytes.

The rules, each raising :class:`MalformedAvroError` with the compiled decoder's words: a varint
ends within 10 bytes and within 64 bits; a length is not negative and ends inside the
message; an array block's count is not the lowest long and is no more than the bytes left
(each item takes at least one byte there); a union's branch exists; a boolean, float or
double is not cut short. Named types, nested records, arrays, maps, enums and fixed types
are followed; the walk nests as the schema does (the envelope's types do not recurse).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_LONG_MIN = -(1 << 63)

Check = Callable[[bytes, int], int]


class MalformedAvroError(ValueError):
    """Bytes that are not a well-formed Avro body of the schema."""


def read_long(data: bytes, pos: int) -> tuple[int, int]:
    """The zigzag varint at ``pos`` and the position past it, as the compiled decoder reads
    it (at most 10 bytes, no bit past 64)."""
    acc = shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise MalformedAvroError("truncated varint")
        b = data[pos]
        pos += 1
        if shift == 63 and b & 0x7E:
            raise MalformedAvroError("varint overflows 64 bits")
        acc |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
        if shift > 63:
            raise MalformedAvroError("varint longer than 10 bytes")
    return (acc >> 1) ^ -(acc & 1), pos


def compile_check(schema_json: str | Mapping[str, Any]) -> Check:
    """The check of one writer schema: ``check(data, pos)`` returns where the body ends, or
    raises :class:`MalformedAvroError`."""
    schema = json.loads(schema_json) if isinstance(schema_json, str) else schema_json
    named: dict[str, Check] = {}
    return _compile(schema, None, named)


def _full(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _compile(s: Any, namespace: str | None, named: dict[str, Check]) -> Check:
    if isinstance(s, list):
        branches = [_compile(b, namespace, named) for b in s]
        return _union(branches)
    if isinstance(s, str):
        if s in PRIMITIVES:
            return _PRIMITIVE[s]
        full = _full(s, namespace)
        if full not in named and s not in named:
            raise ValueError(f"unknown type {s!r} in the schema")
        ref = full if full in named else s
        return named[ref]  # a record's entry exists before its fields are compiled
    kind = s.get("type")
    if kind in PRIMITIVES:  # {"type": "string", "logicalType": ...}
        return _PRIMITIVE[kind]
    if kind in {"record", "error"}:
        ns = s.get("namespace", namespace)
        full = _full(s["name"], ns)
        fields: list[Check] = []
        named[full] = lambda data, pos: _record(fields, data, pos)
        fields.extend(_compile(f["type"], ns, named) for f in s["fields"])
        return named[full]
    if kind == "array":
        return _array(_compile(s["items"], namespace, named))
    if kind == "map":
        return _map(_compile(s["values"], namespace, named))
    if kind == "enum":
        full = _full(s["name"], s.get("namespace", namespace))
        named[full] = _enum(len(s["symbols"]))
        return named[full]
    if kind == "fixed":
        full = _full(s["name"], s.get("namespace", namespace))
        named[full] = _fixed(int(s["size"]))
        return named[full]
    return _compile(kind, namespace, named)  # {"type": "some.Named"} or a nested type


def _null(data: bytes, pos: int) -> int:
    return pos


def _boolean(data: bytes, pos: int) -> int:
    if pos >= len(data):
        raise MalformedAvroError("truncated boolean")
    return pos + 1


def _long(data: bytes, pos: int) -> int:
    return read_long(data, pos)[1]


def _sized(size: int) -> Check:
    def check(data: bytes, pos: int) -> int:
        if len(data) - pos < size:
            raise MalformedAvroError("truncated float or double")
        return pos + size

    return check


def _bytes(data: bytes, pos: int) -> int:
    n, pos = read_long(data, pos)
    if n < 0:
        raise MalformedAvroError("negative length")
    if n > len(data) - pos:
        raise MalformedAvroError("length past the end of the message")
    return pos + n


def _string(data: bytes, pos: int) -> int:
    end = _bytes(data, pos)
    start = end - read_long(data, pos)[0]
    try:
        data[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedAvroError(f"string is not UTF-8: {exc.reason}") from None
    return end


_PRIMITIVE: dict[str, Check] = {
    "null": _null, "boolean": _boolean, "int": _long, "long": _long, "float": _sized(4),
    "double": _sized(8), "bytes": _bytes, "string": _string,
}  # fmt: skip


def _record(fields: list[Check], data: bytes, pos: int) -> int:
    for field in fields:
        pos = field(data, pos)
    return pos


def _blocks(item: Check, data: bytes, pos: int, per_item: int) -> int:
    while True:
        count, pos = read_long(data, pos)
        if count == 0:
            return pos
        if count < 0:
            if count == _LONG_MIN:
                raise MalformedAvroError("array block count out of range")
            _, pos = read_long(data, pos)  # the block's size in bytes: not needed
            count = -count
        if count > len(data) - pos:  # every item takes at least one byte
            raise MalformedAvroError("array longer than the message")
        for _ in range(count):
            pos = item(data, pos) if per_item == 1 else item(data, _string(data, pos))
    return pos


def _array(item: Check) -> Check:
    return lambda data, pos: _blocks(item, data, pos, 1)


def _map(value: Check) -> Check:
    return lambda data, pos: _blocks(value, data, pos, 2)  # each entry: a string key, a value


def _union(branches: list[Check]) -> Check:
    def check(data: bytes, pos: int) -> int:
        index, pos = read_long(data, pos)
        if not 0 <= index < len(branches):
            raise MalformedAvroError("union branch out of range")
        return branches[index](data, pos)

    return check


def _enum(symbols: int) -> Check:
    def check(data: bytes, pos: int) -> int:
        index, pos = read_long(data, pos)
        if not 0 <= index < symbols:
            raise MalformedAvroError("enum symbol out of range")
        return pos

    return check


def _fixed(size: int) -> Check:
    def check(data: bytes, pos: int) -> int:
        if len(data) - pos < size:
            raise MalformedAvroError("fixed value past the end of the message")
        return pos + size

    return check
