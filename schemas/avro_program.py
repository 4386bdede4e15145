"""An Avro schema compiled into the program the compiled core's coder (rust/src/avro.rs) walks.

A program is nested tuples, opcode first: ``(ARRAY, item)``, ``(RECORD, names, fields)``,
``(UNION, branches, labels)`` (a label is the branch's full record name, or None: the
value is then returned bare, as fastavro does with ``return_record_name=True``), and one
tuple per primitive. Given ``classes`` (full record name -> a slotted dataclass with the
record's fields), records become ``(OBJECT, class, slots, fields)`` (instances built
directly), arrays ``(TUPLE, item)`` and record branches of unions bare objects: the codec
then decodes straight into its own types.

:func:`compile_schema` raises :class:`UnsupportedSchemaError` for what the compiled coder does
not cover (maps, enums, fixed, logical types, recursive or zero-byte array items); the
codec then decodes with fastavro. ``decoder()`` is the compiled ``decode`` or None where
the extension was not built; ``encoder()`` likewise its ``encode``, which walks the same
programs to write a value's body (the codec's encoding of its own types).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MemberDescriptorType
from typing import Any

NULL, BOOLEAN, INT, LONG, FLOAT, DOUBLE, BYTES, STRING, ARRAY, RECORD, UNION, TUPLE, OBJECT = range(
    13
)
Program = tuple[Any, ...]
Decoder = Callable[
    [Program, bytes, int], tuple[Any, int]
]  # (program, data, offset) -> (value, end)
Encoder = Callable[[Program, Any, bytes], bytes]  # (program, value, header) -> header + body

_PRIMITIVES: dict[str, Program] = {
    "null": (NULL,),
    "boolean": (BOOLEAN,),
    "int": (INT,),
    "long": (LONG,),
    "float": (FLOAT,),
    "double": (DOUBLE,),
    "bytes": (BYTES,),
    "string": (STRING,),
}


class UnsupportedSchemaError(ValueError):
    """A schema the compiled decoder does not cover."""


def compile_schema(schema: Any, classes: Mapping[str, type] | None = None) -> Program:
    """The program of ``schema`` (its JSON form: str, list or dict); with ``classes``, one
    that builds those classes' instances (every record must have one)."""
    named: dict[str, Program] = {}

    def walk(s: Any, namespace: str | None) -> Program:
        if isinstance(s, str):
            if s in _PRIMITIVES:
                return _PRIMITIVES[s]
            ref = named.get(_full_name(s, namespace)) or named.get(s)
            if ref is None:
                raise UnsupportedSchemaError(f"name {s!r} used before it is defined (or recursive)")
            return ref
        if isinstance(s, list):
            branches = tuple(walk(b, namespace) for b in s)
            labels = tuple(None if classes else _label(b, namespace, named) for b in s)
            return (UNION, branches, labels)
        if not isinstance(s, dict) or "type" not in s:
            raise UnsupportedSchemaError(f"not a schema: {s!r}")
        if "logicalType" in s:
            raise UnsupportedSchemaError(f"logical type {s['logicalType']!r}")
        kind = s["type"]
        if isinstance(kind, str) and kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        if kind == "array":
            item = walk(s["items"], namespace)
            if _min_size(item) == 0:
                raise UnsupportedSchemaError("array items that may take no byte")
            return (TUPLE if classes else ARRAY, item)
        if kind in ("record", "error"):
            name = _full_name(s["name"], s.get("namespace", namespace))
            inner = name.rpartition(".")[0] or None
            # Registered once its fields are known: a field naming the record itself (a
            # recursive schema) is then "used before it is defined".
            fields = tuple(walk(f["type"], inner) for f in s["fields"])
            names = tuple(f["name"] for f in s["fields"])
            program: Program = (
                _object(name, names, fields, classes) if classes else (RECORD, names, fields)
            )
            named[name] = program
            return program
        raise UnsupportedSchemaError(f"type {kind!r}")

    return walk(schema, None)


def _object(
    name: str, names: tuple[str, ...], fields: Program, classes: Mapping[str, type]
) -> Program:
    """(OBJECT, class, member descriptors in field order, field programs)."""
    cls = classes.get(name)
    if cls is None:
        raise UnsupportedSchemaError(f"no class for record {name}")
    if not dataclasses.is_dataclass(cls) or "__post_init__" in vars(cls):
        raise UnsupportedSchemaError(f"{cls.__name__} is not a plain dataclass")
    if {f.name for f in dataclasses.fields(cls)} != set(names) or set(
        getattr(cls, "__slots__", ())
    ) != set(names):
        raise UnsupportedSchemaError(f"{cls.__name__}'s slots are not record {name}'s fields")
    slots = tuple(vars(cls)[n] for n in names)
    if not all(isinstance(s, MemberDescriptorType) for s in slots):
        raise UnsupportedSchemaError(f"{cls.__name__} has no slots")
    return (OBJECT, cls, slots, fields)


def _full_name(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _label(s: Any, namespace: str | None, named: dict[str, Program]) -> str | None:
    """A union branch's name as fastavro reports it (records only)."""
    if isinstance(s, dict) and s.get("type") in ("record", "error"):
        return _full_name(s["name"], s.get("namespace", namespace))
    if isinstance(s, str) and s not in _PRIMITIVES:
        full = _full_name(s, namespace)
        return full if full in named else s
    return None


def _min_size(p: Program) -> int:
    op = p[0]
    if op == NULL:
        return 0
    if op == FLOAT:
        return 4
    if op == DOUBLE:
        return 8
    if op == RECORD:
        return sum(_min_size(f) for f in p[2])
    if op == OBJECT:  # (OBJECT, class, slots, fields)
        return sum(_min_size(f) for f in p[3])
    return 1  # a boolean, a varint, a length, a block count, a branch index


def decoder() -> Decoder | None:
    try:
        from kvledger._core import decode
    except ImportError:  # built without a Rust toolchain
        return None
    return decode


def encoder() -> Encoder | None:
    try:
        from kvledger._core import encode
    except ImportError:  # built without a Rust toolchain
        return None
    return encode
