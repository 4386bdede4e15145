"""The lookup service's OpenAPI 3.1 document (served at GET /openapi.json): its paths
generated from the route table (:mod:`.table`), its schemas here (Dynamo's in
:mod:`.openapi_dynamo`). The tests check the document against the service's real answers
(tests/test_lookup.py validates each response against these schemas).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvledger.serving.lookup.requests import MAX_HASHES, MAX_NAME_CHARS, MAX_TOKENS

if TYPE_CHECKING:
    from kvledger.serving.lookup.table import Route

NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS}
ERROR_REF = {"$ref": "#/components/schemas/Error"}


def ref(schema: str) -> dict[str, str]:
    """A reference to a component schema."""
    return {"$ref": f"#/components/schemas/{schema}"}


DASHBOARD_MINUTES = {"type": "integer", "minimum": 1, "maximum": 1440, "default": 60}


def response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A JSON response of ``schema``."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
ERRORS = {
    "400": response(ERROR_REF, "The request is malformed; `error` says how"),
    "401": response(ERROR_REF, "A bearer token is required (the service runs with --token-file)"),
    "503": {
        **response(
            ERROR_REF,
            "The database is busy or unavailable, a lookup ran past its timeout, or the "
            "index schema is missing (run `kvledger migrate`)",
        ),
        "headers": RETRY_AFTER,
    },
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "MatchRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["model"],
        "description": "Exactly one of `hashes` and `token_ids`.",
        "properties": {
            "model": NAME,
            "group_idx": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1, "default": 0},
            "hashes": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_HASHES,
                "description": "The prompt's block hashes in order: hex strings (0x optional) "
                "or 64-bit integers, vLLM's unsigned form or SGLang's signed one (the same 8 "
                "bytes: -1 is 18446744073709551615)",
                "items": {
                    "oneOf": [
                        {"type": "string", "pattern": "^(0x)?([0-9a-fA-F]{2})+$"},
                        {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
                    ]
                },
            },
            "token_ids": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_TOKENS,
                "items": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
            },
            "granularity": {
                "enum": ["block", "hash"],
                "default": "block",
                "description": "With hashes: one per block, or one per hash block (tails)",
            },
            "at": {
                "type": "string",
                "format": "date-time",
                "description": "With hashes: the answer as of this time (with a time zone), "
                "within the retained history (else a 410)",
            },
            "lora_name": {**NAME, "description": "With token_ids: only this adapter's blocks"},
            "cache_salt": {
                **NAME,
                "description": "With token_ids: the cache salt the engine hashed the prompt "
                "with (the walk starts at the first blocks of that salt)",
            },
            "state_group": {
                "type": "integer",
                "minimum": 0,
                "description": "With hashes (block granularity, now): a hybrid model's "
                "recurrent group; the answer's state_checkpoints then says, per instance, "
                "the deepest position within its prefix where it holds the state",
            },
            "load": {
                "type": "boolean",
                "default": False,
                "description": "The answer's load then gives each live engine of the model "
                "whose relay reads its metrics (kvledger relay --engine-metrics-url) the "
                "requests it is running and has queued (not with at)",
            },
            "weights": {
                "type": "object",
                "additionalProperties": {"type": "number"},
                "description": "Tier weights of the ranking (default GPU 1, CPU 0.8, STORAGE 0.5)",
            },
            "include_silent": {"type": "boolean", "default": False},
            "silent_after_s": {"type": "number", "exclusiveMinimum": 0},
        },
    },
    "Holder": {
        "type": "object",
        "required": [
            "instance",
            "medium",
            "ownership",
            "matched_blocks",
            "matched_tokens",
            "source_state",
        ],
        "properties": {
            "instance": {"type": "string"},
            "medium": {"type": "string", "examples": ["GPU", "CPU", "STORAGE"]},
            "ownership": {"type": "string"},
            "matched_blocks": {"type": "integer", "minimum": 0},
            "matched_tokens": {"type": "integer", "minimum": 0},
            "source_state": {"enum": ["live", "silent", "closed", "unknown", "as_of"]},
            "provisional": {
                "const": True,
                "description": "Present (true) where a router reported sending this prompt "
                "to the instance (POST /v1/decisions) and its engine's events have not shown "
                "the blocks yet: answered for the service's --provisional-window",
            },
        },
    },
    "DecisionRequest": {
        "type": "object",
        "required": ["model", "instance"],
        "additionalProperties": False,
        "properties": {
            "model": {"type": "string"},
            "group_idx": {"type": "integer", "minimum": 0, "default": 0},
            "instance": {"type": "string", "description": "The instance the prompt went to"},
            "token_ids": {"type": "array", "items": {"type": "integer"}},
            "hashes": {"type": "array", "items": {"type": ["string", "integer"]}},
            "lora_name": {"type": "string"},
            "cache_salt": {"type": "string"},
            "request_id": {"type": "string"},
        },
        "description": "Exactly one of token_ids and hashes (as /v1/match takes them).",
    },
    "DecisionAnswer": {
        "type": "object",
        "required": ["instance", "provisional_blocks", "expires_in_s"],
        "properties": {
            "instance": {"type": "string"},
            "provisional_blocks": {"type": "integer", "minimum": 0},
            "expires_in_s": {"type": "number"},
        },
    },
    "Ranked": {
        "type": "object",
        "required": ["instance", "score", "tokens_by_tier"],
        "properties": {
            "instance": {"type": "string"},
            "score": {"type": "number"},
            "tokens_by_tier": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    },
    "MatchAnswer": {
        "type": "object",
        "required": ["holders", "ranked", "left_out"],
        "properties": {
            "holders": {"type": "array", "items": {"$ref": "#/components/schemas/Holder"}},
            "ranked": {"type": "array", "items": {"$ref": "#/components/schemas/Ranked"}},
            "left_out": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/Holder"},
                "description": "Holders whose source is not live (answers for now only)",
            },
            "state_checkpoints": {
                "type": "object",
                "additionalProperties": {"type": "integer"},
                "description": "With state_group: per instance, the deepest position (in "
                "blocks) within its matched prefix at whose hash it holds a state checkpoint "
                "of that group (vLLM 0.34's recurrent groups); a hybrid model's prefix is "
                "reusable up to there. An instance without one is absent.",
            },
            "in_flight": {
                "type": "object",
                "additionalProperties": {"type": "integer"},
                "description": "Memory mode: per instance, the decisions routed there in the "
                "provisional window that its engine's events have not confirmed yet",
            },
            "load": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["running", "waiting", "age_s"],
                    "properties": {
                        "running": {"type": ["integer", "null"]},
                        "waiting": {"type": ["integer", "null"]},
                        "age_s": {
                            "type": "number",
                            "description": "Seconds since the "
                            "heartbeat that carried it (a reading every interval)",
                        },
                    },
                },
                "description": "With load: per live engine of the model that reports one, "
                "the requests its engine was running and had queued when its relay last "
                "read them; ends with the engine's life (a restart, a goodbye)",
            },
            "unknown_group": {
                "type": "string",
                "description": "Present when the answer is empty because the index has no "
                "group spec for the model and group asked (a mistyped name or index, or "
                "engines that have not announced it yet): why, in words. Absent otherwise: "
                "an empty answer without it is a plain miss.",
            },
        },
    },
    "Residency": {
        "type": "object",
        "required": ["instance", "medium", "ownership", "locality", "since", "refcount"],
        "properties": {
            "instance": {"type": "string"},
            "medium": {"type": "string"},
            "ownership": {"type": "string"},
            "locality": {"type": ["string", "null"]},
            "since": {"type": "string", "format": "date-time"},
            "refcount": {"type": "integer", "minimum": 1},
        },
    },
    "Block": {
        "type": "object",
        "required": [
            "model",
            "group_idx",
            "block_hash",
            "parent_hash",
            "token_start",
            "token_end",
            "block_size",
            "partial",
            "lora_name",
            "first_seen",
            "last_seen",
            "holders",
        ],
        "properties": {
            "model": {"type": "string"},
            "group_idx": {"type": "integer"},
            "block_hash": {"type": "string", "description": "hex"},
            "parent_hash": {"type": ["string", "null"]},
            "token_start": {"type": ["integer", "null"]},
            "token_end": {"type": ["integer", "null"]},
            "block_size": {"type": "integer"},
            "partial": {"type": "boolean"},
            "lora_name": {"type": ["string", "null"]},
            "first_seen": {"type": "string", "format": "date-time"},
            "last_seen": {"type": "string", "format": "date-time"},
            "holders": {"type": "array", "items": {"$ref": "#/components/schemas/Residency"}},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"enum": ["ok", "stopped"]},
            "mode": {"enum": ["memory"]},
            "position": {"type": "object", "description": "memory mode: the router's log position"},
            "standby": {"type": "boolean", "description": "SQL mode on a hot standby"},
            "replay_lag_s": {
                "type": ["number", "null"],
                "description": "on a standby: seconds its replay is behind the primary",
            },
            "replay_lsn": {"type": ["string", "null"]},
        },
    },
}

# The routes' parameters and answers (the table's entries name them).
BLOCK_HASH = {
    "name": "block_hash",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The hash as hex (0x optional), or as a 64-bit int in decimal (vLLM's "
    "unsigned form, or SGLang's signed one with a minus sign). Digits alone of an even count "
    "read as hex first, then as the int (the first with rows answers); 0x makes it hex only.",
}
MINUTES = {
    "name": "minutes",
    "in": "query",
    "required": False,
    "schema": DASHBOARD_MINUTES,
    "description": "The window of the series, in minutes",
}
INDEX = {
    "type": "object",
    "required": ["service", "version", "mode", "routes", "openapi"],
    "properties": {
        "service": {"type": "string"},
        "version": {"type": "string"},
        "mode": {"enum": ["sql", "memory"]},
        "dynamo_api": {"type": "boolean"},
        "routes": {"type": "array", "items": {"type": "string"}},
        "openapi": {"type": "string"},
    },
}
UI_PAGE = {
    "description": "The page (no data: it asks GET /v1/dashboard with the user's token)",
    "content": {"text/html": {"schema": {"type": "string"}}},
}
UI_SCRIPT = {
    "description": "The script",
    "content": {"text/javascript": {"schema": {"type": "string"}}},
}
UI_MISSING = response(ERROR_REF, "Not installed here (scripts/vendor-ui vendors it)")
GONE = response(
    ERROR_REF,
    "`at` is before the retained history (retention dropped it); `error` says where the "
    "retained history starts",
)


# The documented answers of the gate's refusals, added to each route's own.
UNAUTHORIZED = ERRORS["401"]
NO_LENGTH = response(ERROR_REF, "A body without Content-Length")
OVER_RATE = {
    **response(ERROR_REF, "This client reported over 2,000 decisions a second"),
    "headers": RETRY_AFTER,
}


INFO = {
    "title": "kvledger lookup service",
    "version": "1",
    "description": "Which serving instances hold the longest prefix of a prompt's KV-cache "
    "blocks, on which tier; answered from the durable index (SQL) or from a router's "
    "in-memory copy of it (`kvledger serve --memory`).",
}


def document(routes: Iterable[Route]) -> dict[str, Any]:
    """The OpenAPI document of ``routes`` (the service's table, :mod:`.table`): each
    route's own facts, and the answers of the gate's refusals its entry implies (401 where
    it needs a token, its body's 411/413, 429 past its rate)."""
    schemas = dict(SCHEMAS)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        op: dict[str, Any] = {"operationId": route.name, "summary": route.summary}
        if route.dynamo:
            op["tags"] = ["dynamo"]
            from kvledger.serving.lookup.openapi_dynamo import DYNAMO_SCHEMAS

            schemas.update(DYNAMO_SCHEMAS)
        if route.role == "open":
            op["security"] = [{}]
        if route.parameters:
            op["parameters"] = [dict(p) for p in route.parameters]
        answers = dict(route.responses)
        if route.body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": dict(route.body.schema)}},
            }
            answers.setdefault(str(route.body.missing), NO_LENGTH)
            answers.setdefault(str(route.body.over), response(ERROR_REF, "The body is too large"))
        if route.role != "open":
            answers.setdefault("401", UNAUTHORIZED)
        if route.rate is not None:
            answers.setdefault("429", OVER_RATE)
        op["responses"] = dict(sorted(answers.items()))
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": INFO,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
        "paths": paths,
    }
