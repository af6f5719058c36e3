"""The OpenAPI 3.1 document of the gateway's own HTTP surface, served at ``/openapi.json``.

Request schemas are derived from :data:`gateway.request.fields.FIELD_RULES`, the same
table the parser enforces, so the document cannot drift from what a request is checked
against. Built once per process; the served bytes are cached too. The inference and
operations paths are here; the admin API's live in :mod:`~gateway.http.openapi.admin`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from aiohttp import web

from gateway.http.openapi.admin import admin_paths
from gateway.http.openapi.engine_apis import engine_components, engine_paths
from gateway.http.openapi.schema import (
    ENDPOINT_ROW,
    INFERENCE_ERRORS,
    OPTIONAL_AUTH,
    READY,
    Schema,
    components,
    get_operation,
    inference_operation,
    json_content,
    ok,
    ref,
)

__all__ = ["openapi_document", "serve_openapi"]

_VERSION = "0.1.0"


def _paths() -> dict[str, Schema]:
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "/v1/chat/completions": inference_operation(
            "Chat completion, routed to the best replica",
            "ChatCompletionRequest",
            "ChatCompletion",
            streams=True,
        ),
        "/v1/completions": inference_operation(
            "Text completion, routed to the best replica", "CompletionRequest", "Completion", streams=True
        ),
        "/v1/embeddings": inference_operation(
            "Embeddings, routed to the best replica", "EmbeddingRequest", "EmbeddingList", streams=False
        ),
        "/v1/models": get_operation(
            "Models served by at least one healthy endpoint",
            "listModels",
            {"200": ok("The model list.", json_content(ref("ModelList"))), "401": INFERENCE_ERRORS["401"]},
            security=OPTIONAL_AUTH,
        ),
        "/health": get_operation(
            "Liveness: the process answers",
            "health",
            {
                "200": ok(
                    "Alive.", json_content({"type": "object", "properties": {"status": {"const": "ok"}}})
                )
            },
        ),
        "/ready": get_operation(
            "Readiness: at least one healthy endpoint",
            "ready",
            {
                "200": ok("Ready.", json_content(READY)),
                "503": ok("Not ready (no healthy endpoint).", json_content(READY)),
            },
        ),
        "/metrics": get_operation(
            "Prometheus metrics (text exposition format)", "metrics", {"200": ok("Metrics.", text)}
        ),
        "/debug/endpoints": get_operation(
            "What the gateway believes about each endpoint",
            "debugEndpoints",
            {
                "200": ok(
                    "One row per endpoint.",
                    json_content(
                        {
                            "type": "object",
                            "required": ["endpoints"],
                            "properties": {"endpoints": {"type": "array", "items": ENDPOINT_ROW}},
                        }
                    ),
                )
            },
        ),
        "/openapi.json": get_operation(
            "This document",
            "openapi",
            {
                "200": ok(
                    "OpenAPI 3.1 document.",
                    json_content({"type": "object", "required": ["openapi", "info", "paths"]}),
                )
            },
        ),
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document, built on first use and shared afterwards: callers must not mutate it."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llm-gateway",
            "version": _VERSION,
            "description": "OpenAI-compatible, LLM-aware routing gateway in front of vLLM / SGLang replicas.",
        },
        "paths": {**_paths(), **engine_paths(), **admin_paths()},
        "components": _with_engine_schemas(components()),
    }


def _with_engine_schemas(parts: dict[str, Any]) -> dict[str, Any]:
    parts["schemas"].update(engine_components())
    return parts


@functools.cache
def _document_bytes() -> bytes:
    return json.dumps(openapi_document(), separators=(",", ":")).encode()


async def serve_openapi(http_request: web.Request) -> web.Response:
    return web.Response(body=_document_bytes(), content_type="application/json")
