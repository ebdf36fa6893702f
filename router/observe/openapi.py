"""The router's HTTP API as an OpenAPI 3 document, served at ``GET /openapi.json``.

Built here, next to the handlers in :mod:`router.app`, so that it ships with the package and a
test can fuzz the running router from it (``tests/e2e/router/test_openapi.py``). Request bodies
are described as far as the router itself reads them; every other field is passed to the engine
as it is (``additionalProperties``), and the engine's own answers (a completion, a stream) are
passed back byte for byte, so their schemas name only the fields the router relies on.
"""

from __future__ import annotations

import functools
import json
from importlib import metadata
from typing import Any

from kvtokens.sampling import NUMBERS
from router.observe.dashboard import DASHBOARD_SCHEMAS

JSON = "application/json"
ERROR_REF = {"$ref": "#/components/schemas/Error"}
OPTIONAL_BEARER: list[dict[str, list[str]]] = [{}, {"bearer": []}]  # only with --api-key


def _version() -> str:
    try:
        return metadata.version("kvroute")
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        return "0.0.0"


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": ERROR_REF}}}


def _errors(*statuses: int) -> dict[str, Any]:
    why = {
        400: "malformed JSON or fields (one line in `error.message`)",
        401: "a valid bearer key is required (with --api-key)",
        404: "the model does not exist (the message lists the models served)",
        408: "the body did not arrive within --body-timeout-s (the connection is closed)",
        413: "the body exceeds --max-body-bytes or the prompt --max-prompt-tokens",
        429: "more than --max-inflight requests in flight; retry after `Retry-After` seconds",
        502: "every worker tried failed before its first byte",
        503: "no alive worker of the model, or no view of the workers yet (Redis never reached)",
    }
    return {str(status): _error(why[status]) for status in statuses}


TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": 4294967295}}


def _sampling_fields() -> dict[str, Any]:
    """The sampling fields the router checks (kvtokens.sampling), as their rules say."""
    fields: dict[str, Any] = {}
    for name, bound in NUMBERS.items():
        schema: dict[str, Any] = {"type": "integer" if bound.integer else "number", "nullable": True}
        if bound.low is not None:  # OpenAPI 3.0: exclusiveMinimum is a flag on minimum
            schema |= {"minimum": bound.low, "exclusiveMinimum": True} if bound.open_low else {"minimum": bound.low}
        if bound.high is not None:
            schema["maximum"] = bound.high
        fields[name] = schema
    fields["stop"] = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}], "nullable": True}
    return fields


COMMON_FIELDS: dict[str, Any] = {
    **_sampling_fields(),
    "model": {
        "type": "string",
        "minLength": 1,
        "description": "a model served by the fleet, or a LoRA adapter of one (GET /v1/models)",
    },
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "cache_salt": {
        "type": "string",
        "minLength": 1,
        "description": "folded into the first block's hash, as vLLM does: a tenant's cache is its own",
    },
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": "string", "nullable": True},
                    "code": {"type": "integer"},
                },
            }
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "additionalProperties": True,
        "properties": {
            **COMMON_FIELDS,
            "prompt": {
                "description": "a text, token ids, or a batch of either (the first prompt routes a batch)",
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    TOKEN_IDS,
                    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                    {"type": "array", "minItems": 1, "items": TOKEN_IDS},
                ],
            },
            "add_special_tokens": {"type": "boolean", "default": True},
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "additionalProperties": True,
        "properties": {
            "role": {"type": "string"},
            "content": {
                "nullable": True,
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                        },
                    },
                ],
            },
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "additionalProperties": True,
        "properties": {
            **COMMON_FIELDS,
            "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}},
            "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
            "add_generation_prompt": {"type": "boolean", "default": True},
        },
    },
    "EngineReply": {
        "type": "object",
        "description": "the engine's completion, passed through; `usage` feeds the router's metrics",
        "additionalProperties": True,
        "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "usage": {"type": "object"}},
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "owned_by"],
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string"},
                        "owned_by": {"type": "string"},
                        "parent": {
                            "type": "string",
                            "description": "a LoRA adapter's base model (absent for a base model)",
                        },
                    },
                },
            },
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "replica"],
        "properties": {"status": {"type": "string", "enum": ["ok"]}, "replica": {"type": "string"}},
    },
    "Readiness": {
        "type": "object",
        "required": ["ready", "redis", "workers", "models", "retained_models", "degraded", "worker_view_age_s"],
        "properties": {
            "ready": {"type": "boolean", "description": "this replica can route (a view of alive workers)"},
            "redis": {"type": "boolean", "description": "the last refresh of the workers reached Redis"},
            "workers": {"type": "boolean"},
            "models": {"type": "array", "items": {"type": "string"}},
            "retained_models": {
                "type": "array",
                "items": {"type": "string"},
                "description": "served from their last known workers while Redis lists none alive",
            },
            "degraded": {"type": "boolean"},
            "worker_view_age_s": {"type": "number", "nullable": True},
            "reason": {"type": "string", "description": "why not ready"},
        },
    },
    "LearnedModel": {
        "type": "object",
        "required": [
            "source",
            "base_ms",
            "prefill_tokens_per_s",
            "observations",
            "whole_reply_observations",
            "typical_uncached_tokens",
            "reuse",
            "utilization",
            "workers",
        ],
        "properties": {
            "source": {
                "type": "string",
                "enum": ["prior", "streamed", "whole_replies"],
                "description": "what set the fleet's rate: the prior (nothing seen yet), streamed first "
                "bytes, or whole replies of requests not streamed (fitted with their completion tokens)",
            },
            "base_ms": {"type": "number", "description": "the fleet's time to first token with no prefill"},
            "prefill_tokens_per_s": {"type": "number", "nullable": True},
            "observations": {"type": "number", "description": "streamed first bytes, decayed (half-life 200)"},
            "whole_reply_observations": {"type": "number"},
            "decode_ms_per_token": {
                "type": "number",
                "nullable": True,
                "description": "the decode time per completion token learned from whole replies "
                "(null: not learned; their prefill rate and base exclude it)",
            },
            "prefill_context_ns": {
                "type": "number",
                "description": "attention's share of prefill learned: ns per new token per token of context "
                "(a chunk of N new tokens after P computed takes this x N x (P + N/2) beyond its linear cost; 0: "
                "not seen)",
            },
            "typical_uncached_tokens": {"type": "number"},
            "reuse": {"type": "number", "description": "share of prompt tokens the engines reported cached"},
            "utilization": {"type": "number", "description": "share of workers with prefill queued at decisions"},
            "model": {
                "type": "string",
                "nullable": True,
                "description": "the model this is of (?model=, default the first served; null: none served)",
            },
            "models": {"type": "array", "items": {"type": "string"}, "description": "models served or learned"},
            "shared": {
                "type": "object",
                "description": "the model is learned with the other replicas through Redis (--model-sync-ms)",
                "properties": {
                    "enabled": {"type": "boolean"},
                    "last_sync_ms_ago": {"type": "number", "nullable": True},
                    "syncs": {"type": "integer"},
                    "failures": {"type": "integer"},
                },
            },
            "workers": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "prefill_tokens_per_s", "observations", "whole_reply_observations"],
                    "properties": {
                        "id": {"type": "string"},
                        "prefill_tokens_per_s": {"type": "number", "nullable": True},
                        "observations": {"type": "number"},
                        "whole_reply_observations": {"type": "number"},
                    },
                },
            },
        },
    },
    "RouteExplanation": {
        "type": "object",
        "required": ["model", "prompt_tokens", "prompt_blocks", "block_size", "degraded", "chosen", "workers"],
        "properties": {
            "model": {"type": "string"},
            "prompt_tokens": {"type": "integer"},
            "prompt_blocks": {"type": "integer"},
            "block_size": {"type": "integer"},
            "degraded": {"type": "boolean", "description": "decided without Redis (local round robin)"},
            "chosen": {"type": "string"},
            "predicted_cached_tokens": {"type": "integer"},
            **{
                name: {"type": "integer", "nullable": True, "description": what}
                for name, what in {
                    "best_match_tokens": "the most cached tokens any alive worker was predicted to hold",
                    "lost_load_tokens": "best match - chosen worker's match: given up for load",
                    "lost_stale_tokens": "always null here: it needs the engine's reported cached tokens",
                    "cold_tokens": "cacheable tokens no worker held (whole blocks, at most prompt - 1)",
                }.items()
            },
            "workers": {
                "type": "array",
                "items": {
                    "type": "object",
                    "description": "one alive worker, best first",
                    "properties": {
                        "id": {"type": "string"},
                        "url": {"type": "string"},
                        "matched_blocks": {"type": "integer"},
                        "load": {"type": "object"},
                        "cost": {"type": "number", "description": "seconds: the predicted TTFT and cache pressure"},
                        "busy": {"type": "boolean"},
                        "pending_blocks": {"type": "integer"},
                        "held_blocks": {
                            "type": "integer",
                            "description": "leading blocks of the prompt that requests in flight there compute or hold",
                        },
                        "hit_blocks": {
                            "type": "integer",
                            "description": "matched blocks predicted still cached when the prompt is scheduled there",
                        },
                        "cached_blocks": {"type": "integer"},
                        "prefill_tokens": {"type": "integer"},
                        "predicted_ttft_ms": {"type": "number"},
                    },
                },
            },
        },
    },
}

SCHEMAS.update(DASHBOARD_SCHEMAS)

ROUTED_HEADERS = {
    "x-kvroute-worker": {
        "description": "the chosen worker's id (only with routing headers exposed: by default when no API key is set)",
        "schema": {"type": "string"},
    },
    "x-kvroute-cached-tokens": {
        "description": "the prompt tokens predicted cached there (whole blocks, at most prompt length - 1; "
        "only with routing headers exposed)",
        "schema": {"type": "string"},
    },
    "x-request-id": {
        "description": "the request's id: the client's X-Request-Id if it is 1-128 of A-Za-z0-9._:/+=@-, "
        "else a fresh one",
        "schema": {"type": "string"},
    },
}


def _proxied(summary: str, request_schema: str, operation_id: str) -> dict[str, Any]:
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "security": OPTIONAL_BEARER,
            "requestBody": {
                "required": True,
                "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{request_schema}"}}},
            },
            "responses": {
                "200": {
                    "description": "the engine's reply, passed through byte for byte (streamed with `stream`)",
                    "headers": ROUTED_HEADERS,
                    "content": {
                        JSON: {"schema": {"$ref": "#/components/schemas/EngineReply"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 408, 413, 429, 502, 503),
            },
        }
    }


def _get(operation_id: str, summary: str, responses: dict[str, Any], secured: bool = False) -> dict[str, Any]:
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary, "responses": responses}
    if secured:
        operation["security"] = OPTIONAL_BEARER
    return {"get": operation}


def _with_model_query(path: dict[str, Any]) -> dict[str, Any]:
    path["get"]["parameters"] = [
        {
            "name": "model",
            "in": "query",
            "required": False,
            "description": "the model (default: the first served)",
            "schema": {"type": "string"},
        }
    ]
    return path


def _json_reply(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def _paths() -> dict[str, Any]:
    explain_body = {
        "anyOf": [
            {"$ref": "#/components/schemas/CompletionRequest"},
            {"$ref": "#/components/schemas/ChatCompletionRequest"},
        ]
    }
    paths: dict[str, Any] = {
        "/v1/completions": _proxied(
            "A completion, routed to the worker with the lowest cost", "CompletionRequest", "createCompletion"
        ),
        "/v1/chat/completions": _proxied(
            "A chat completion, routed likewise", "ChatCompletionRequest", "createChatCompletion"
        ),
        "/debug/route": {
            "post": {
                "operationId": "explainRoute",
                "summary": "The decision for a completions or chat body (with `messages`), without proxying it "
                "or changing any routing state; served only with --enable-debug",
                "security": OPTIONAL_BEARER,
                "requestBody": {"required": True, "content": {JSON: {"schema": explain_body}}},
                "responses": {
                    "200": _json_reply(
                        "every alive worker, best first, with its match, load and cost", "RouteExplanation"
                    ),
                    **_errors(400, 401, 404, 408, 413, 429, 502, 503),
                },
            }
        },
        "/debug/model": _with_model_query(
            _get(
                "learnedModel",
                "What this replica has learned of a model's engines, with the other replicas: prefill "
                "rates, the base, the averages its decisions use (docs/router.md); served only with "
                "--enable-debug",
                {"200": _json_reply("the learned cost model", "LearnedModel"), **_errors(401, 404, 429)},
                True,
            )
        ),
        "/v1/models": _get(
            "listModels",
            "Models with alive workers",
            {"200": _json_reply("the models", "ModelList"), **_errors(401)},
            True,
        ),
        "/health": _get("health", "Liveness: the process answers", {"200": _json_reply("alive", "Health")}),
        "/ready": _get(
            "ready",
            "Readiness: this replica can route",
            {"200": _json_reply("ready", "Readiness"), "503": _json_reply("not ready, with a reason", "Readiness")},
        ),
        "/metrics": _get(
            "metrics",
            "Prometheus metrics (prefix kvroute_router_)",
            {
                "200": {
                    "description": "the exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        ),
        "/openapi.json": _get(
            "openapi",
            "This document",
            {"200": {"description": "OpenAPI 3", "content": {JSON: {"schema": {"type": "object"}}}}},
        ),
        **_dashboard_paths(),
    }
    return paths


def _dashboard_paths() -> dict[str, Any]:
    """The dashboard's page and files (open), and its JSON (behind the key when one is set)."""

    def text(content_type: str) -> dict[str, Any]:
        return {
            "200": {"description": "served from the package", "content": {content_type: {"schema": {"type": "string"}}}}
        }

    paths = {
        "/dashboard": _get("dashboardPage", "The live dashboard (docs/dashboard.md)", text("text/html")),
        "/dashboard/dashboard.js": _get("dashboardScript", "The dashboard's script", text("text/javascript")),
        "/dashboard/dashboard.css": _get("dashboardStyle", "The dashboard's style sheet", text("text/css")),
    }
    for name, summary in {
        "fleet": "Alive workers with KV usage, queue, in-flight load, indexed blocks; degraded mode; decisions/s",
        "accounting": "Hit rate, predicted vs reported cached tokens, the lost-token split, per bucket",
        "prefixes": "The most hit prefixes: length, workers holding them, hits",
    }.items():
        schema = "Dashboard" + name.capitalize()
        replies = {"200": _json_reply(summary, schema), **_errors(401, 429)}
        paths[f"/dashboard/api/{name}"] = _get(f"dashboard{name.capitalize()}", summary, replies, True)
    return paths


def build_document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kvroute router",
            "version": _version(),
            "description": "A KV-cache-aware, OpenAI-compatible router for vLLM fleets (docs/router.md). Every "
            'error has OpenAI\'s shape: {"error": {"message", "type", "param", "code"}}.',
        },
        "paths": _paths(),
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "with --api-key"}},
        },
    }


@functools.cache
def document_bytes() -> bytes:
    """The document as served (built once per process)."""
    return json.dumps(build_document(), indent=1).encode()
