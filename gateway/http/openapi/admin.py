"""The admin API's paths (``/admin/endpoints``) in the OpenAPI document."""

from __future__ import annotations

from gateway.http.openapi.schema import (
    ENDPOINT_ROW,
    HTTP_PARSER_400,
    Schema,
    error_response,
    json_content,
    ok,
    ref,
)

__all__ = ["admin_paths"]


def admin_paths() -> dict[str, Schema]:
    """``/admin/endpoints``: 404 unless ``auth.admin_key_sha256`` is set, 401 without that key."""
    closed = {
        "401": error_response("Missing or wrong admin key."),
        "404": error_response("The admin API is closed (no admin key configured), or no such endpoint."),
        "400": {**error_response("Invalid body or missing url."), "content": {**json_content(ref("Error"))}},
    }
    conflict = {"409": error_response("Conflict: the URL exists, belongs to another source, or workers > 1.")}
    row = json_content(ENDPOINT_ROW)
    url_body = {
        "required": True,
        "content": json_content(
            {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}}
        ),
    }
    security = [{"adminKey": []}]

    def post(summary: str, operation_id: str, body: Schema, ok: Schema) -> Schema:
        return {
            "summary": summary,
            "operationId": operation_id,
            "security": security,
            "requestBody": body,
            "responses": {**ok, **closed, **conflict},
        }

    endpoint_body = {
        "required": True,
        "content": json_content(
            {
                "type": "object",
                "required": ["url"],
                "properties": {
                    "url": {"type": "string", "description": "http:// or https:// URL"},
                    "models": {"type": "array", "items": {"type": "string"}},
                    "role": {"enum": ["both", "prefill", "decode"]},
                    "engine": {"enum": ["vllm", "sglang"]},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            }
        ),
    }
    rows = json_content(
        {
            "type": "object",
            "required": ["endpoints"],
            "properties": {"endpoints": {"type": "array", "items": ENDPOINT_ROW}},
        }
    )
    return {
        "/admin/endpoints": {
            "get": {
                "summary": "Every endpoint, with its source, breaker and drain state",
                "operationId": "adminListEndpoints",
                "security": security,
                "responses": {"200": ok("One row per endpoint.", rows), **closed, "400": HTTP_PARSER_400},
            },
            "post": post(
                "Add an endpoint (source: admin)",
                "adminAddEndpoint",
                endpoint_body,
                {"201": ok("Added.", row)},
            ),
            "delete": {
                "summary": "Remove an endpoint the admin API added; in-flight requests finish",
                "operationId": "adminRemoveEndpoint",
                "security": security,
                "parameters": [
                    {"name": "url", "in": "query", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": ok(
                        "Removed.", json_content({"type": "object", "properties": {"removed": ENDPOINT_ROW}})
                    ),
                    **closed,
                    **conflict,
                },
            },
        },
        "/admin/endpoints/drain": {
            "post": post(
                "Drain: no new requests, in-flight ones finish",
                "adminDrainEndpoint",
                url_body,
                {"200": ok("Draining.", row)},
            )
        },
        "/admin/endpoints/undrain": {
            "post": post(
                "Back into rotation", "adminUndrainEndpoint", url_body, {"200": ok("In rotation.", row)}
            )
        },
    }
