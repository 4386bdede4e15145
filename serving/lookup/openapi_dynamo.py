"""The OpenAPI schemas of NVIDIA Dynamo's KV-indexer routes, which `kvledger serve
--dynamo-api` adds to the service's own (their entries: :data:`.table.DYNAMO`), with
Dynamo's JSON (serving/lookup/dynamo.py says how kvledger answers them).
"""

from __future__ import annotations

from typing import Any

from kvledger.serving.lookup.openapi import ERROR_REF, response

_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}}
ROUTING = {
    "type": "string",
    "default": "default",
    "description": "`default` is kvledger's group 0; digits N are group N",
}
DYNAMO_SCHEMAS: dict[str, Any] = {
    "DynamoQuery": {
        "type": "object",
        "required": ["token_ids", "model_name"],
        "properties": {
            "token_ids": _TOKENS,
            "model_name": {"type": "string"},
            "routing_group": ROUTING,
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
            "routing_group": ROUTING,
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
            "routing_group": ROUTING,
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

DYNAMO_ERRORS = {
    "400": response(ERROR_REF, "The body is not JSON (or not valid text)"),
    "413": response(ERROR_REF, "The body, or a list in it, is over its bound"),
    "422": response(ERROR_REF, "A field is missing or of the wrong type (all of them are named)"),
}
UNREGISTER = {
    "type": "object",
    "required": ["instance_id", "model_name"],
    "properties": {
        "instance_id": {"type": "integer"},
        "model_name": {"type": "string"},
        "routing_group": ROUTING,
    },
}
