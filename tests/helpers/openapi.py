"""Answers checked against the service's OpenAPI document (tests/test_lookup.py, the Dynamo
routes' tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def conformance(document: dict[str, Any]) -> Callable[[object, str], None]:
    """``conforms(body, schema)``: raises unless ``body`` is valid against the document's
    component ``schema`` (the document itself validated as OpenAPI 3.1 first)."""
    import jsonschema
    from openapi_spec_validator import validate
    from referencing import Registry, Resource

    validate(document)
    registry = Registry().with_resource("urn:api", Resource.from_contents(
        {"$schema": "https://json-schema.org/draft/2020-12/schema", **document}
    ))  # fmt: skip

    def conforms(body: object, schema: str) -> None:
        ref = {"$ref": f"urn:api#/components/schemas/{schema}"}
        jsonschema.Draft202012Validator(ref, registry=registry).validate(body)

    return conforms
