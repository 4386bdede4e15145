"""The OpenAPI description of NVIDIA Dynamo's KV-indexer routes, which `kvledger serve
--dynamo-api` adds to the service's own (:func:`~.openapi.document` joins them), with
Dynamo's JSON and status codes (serving/lookup/dynamo.py says how kvledger answers them).
"""

from __future__ import annotations

from typing import Any

from kvledger.serving.lookup.openapi import ERROR_REF, ERRORS, response

_DYNAMOERRORS = {
    "400": response(ERROR_REF, "The body is not JSON (or not valid text)"),
    "401": ERRORS["401"],
    "413": response(ERROR_REF, "The body, or a list in it, is over its bound"),
    "422": response(ERROR_REF, "A field is missing or of the wrong type (all of them are named)"),
}
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}}
_ROUTING = {"type": "string", "default": "default",
            "description": "`default` is kvledger's group 0; digits N are group N"}  # fmt: skip
DYNAMO_SCHEMAS: dict[str, Any] = {
    "DynamoQuery": {
        "type": "object",
        "required": ["token_ids", "model_name"],
        "properties": {
            "token_ids": _TOKENS,
            "model_name": {"type": "string"},
            "routing_group": _ROUTING,
            "lora_name": {"type": ["string", "null"]},
        },
    },
    "DynamoQueryByHash": {
        "type": "object",
        "required": ["block_hashes", "model_name"],
        "properties": {
            "block_hashes": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "Dynamo's local block hashes (i64 or u64)",
            },
            "model_name": {"type": "string"},
            "routing_group": _ROUTING,
        },
    },
    "DynamoScores": {
        "type": "object",
        "required": ["scores", "frequencies", "instances"],
        "properties": {
            "scores": {
                "type": "object",
                "description": "worker id -> data-parallel rank -> tokens matched on GPU",
                "additionalProperties": {
                    "type": "object",
                    "additionalProperties": {"type": "integer"},
                },
            },
            "frequencies": {"type": "array", "items": {"type": "integer"}},
            "instances": {
                "type": "object",
                "description": "worker id -> tokens matched per tier, each lower tier "
                "continuing from where the tier above ended",
                "additionalProperties": {"type": "object"},
            },
        },
    },
    "DynamoRegistration": {
        "type": "object",
        "required": ["instance_id", "model_name", "endpoint", "block_size"],
        "properties": {
            "instance_id": {"type": "integer", "minimum": 0},
            "model_name": {"type": "string", "maxLength": 256},
            "endpoint": {"type": "string", "maxLength": 2048},
            "block_size": {"type": "integer", "minimum": 1},
            "routing_group": _ROUTING,
            "source": {
                "type": "string",
                "maxLength": 256,
                "description": "kvledger's: the source this worker id names (only one "
                "not seen yet, or the id it has)",
            },
        },
    },
    "DynamoWorker": {
        "type": "object",
        "required": ["instance_id", "status", "model_name", "routing_group", "block_size"],
        "properties": {
            "instance_id": {"type": "integer"},
            "source": {"type": "string"},
            "status": {"enum": ["pending", "active", "paused"]},
            "model_name": {"type": "string"},
            "routing_group": {"type": "string"},
            "block_size": {"type": "integer"},
            "endpoints": {"type": "object"},
            "listeners": {"type": "object"},
            "kvledger_source": {"type": ["string", "null"]},
        },
    },
    "DynamoStatus": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}},
    },
}


def _dynamo_post(operation: str, summary: str, schema: str, answer: str,
                 status: str = "200") -> dict[str, Any]:  # fmt: skip
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"post": {
        "operationId": operation, "summary": summary, "tags": ["dynamo"],
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
        "responses": {status: response({"$ref": f"#/components/schemas/{answer}"}, "Done"),
                      **_DYNAMOERRORS},
    }}  # fmt: skip


DYNAMO_PATHS: dict[str, Any] = {
    "/query": _dynamo_post("dynamo_query", "Dynamo: each worker's match of a prompt's tokens",
                           "DynamoQuery", "DynamoScores"),
    "/query_by_hash": _dynamo_post("dynamo_query_by_hash", "Dynamo: each worker's match of "
                                   "a prompt's local block hashes", "DynamoQueryByHash",
                                   "DynamoScores"),
    "/register": _dynamo_post("dynamo_register", "Dynamo: register a worker",
                              "DynamoRegistration", "DynamoStatus", "201"),
    "/unregister": _dynamo_post("dynamo_unregister", "Dynamo: unregister a worker's "
                                "registrations", "DynamoRegistration", "DynamoStatus"),
    "/workers": {"get": {
        "operationId": "dynamo_workers", "summary": "Dynamo: the workers (kvledger's sources)",
        "tags": ["dynamo"],
        "parameters": [{"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
                       for n in ("model_name", "routing_group")],
        "responses": {"200": response({"type": "array",
                                    "items": {"$ref": "#/components/schemas/DynamoWorker"}},
                                   "The workers"), "401": ERRORS["401"]},
    }},
    "/dump": {"get": {
        "operationId": "dynamo_dump", "summary": "Dynamo: every live worker's blocks as "
        "Dynamo's stored events, per model:routing_group", "tags": ["dynamo"],
        "responses": {"200": response({"type": "object"}, "The events"), "401": ERRORS["401"]},
    }},
    "/health": {"get": {"operationId": "dynamo_health", "summary": "Dynamo: 200",
                        "tags": ["dynamo"], "security": [{}],
                        "responses": {"200": {"description": "Up"}}}},
}  # fmt: skip
# /unregister needs the id and the model alone.
DYNAMO_PATHS["/unregister"]["post"]["requestBody"]["content"]["application/json"]["schema"] = {
    "type": "object", "required": ["instance_id", "model_name"],
    "properties": {"instance_id": {"type": "integer"}, "model_name": {"type": "string"},
                   "routing_group": _ROUTING},
}  # fmt: skip
