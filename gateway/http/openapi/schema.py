"""Schema building blocks of the OpenAPI document: request bodies from the parser's field
rules, response shapes, errors, and the shared components."""

from __future__ import annotations

from typing import Any

from gateway.request.fields import FIELD_RULES, INT_MAX, INT_MIN, NUMBER_MAX, FieldRule
from gateway.request.types import ApiKind, Priority

Schema = dict[str, Any]

_JSON = "application/json"
PRIORITIES = [p.value for p in Priority]


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


# ---- request bodies -------------------------------------------------------------------

_INTEGER: Schema = {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX}
_ANY = ref("JsonValue")
# Any JSON value whose numbers all fit a double: what the parser lets through where it checks no type.
_JSON_VALUE: Schema = {
    "anyOf": [
        {"type": ["string", "boolean", "null"]},
        {"type": "number", "minimum": -NUMBER_MAX, "maximum": NUMBER_MAX},
        {"type": "array", "items": _ANY},
        {"type": "object", "additionalProperties": _ANY},
    ]
}
_TOKEN_IDS: Schema = {"type": "array", "minItems": 1, "items": _INTEGER}
_TEXT_OR_TOKENS: Schema = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        _TOKEN_IDS,
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
    ]
}
_NULLABLE = {"boolean", "string"}


def _field_schema(rule: FieldRule) -> Schema:
    """What :meth:`FieldRule.accepts` accepts, plus ``null``."""
    if rule.kind in ("integer", "number"):
        schema: Schema = {"type": [rule.kind, "null"]}
        if rule.minimum is not None:
            schema["exclusiveMinimum" if rule.exclusive_minimum else "minimum"] = rule.minimum
        if rule.maximum is not None:
            schema["maximum"] = rule.maximum
        return schema
    if rule.kind == "stop":
        return {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]
        }
    if rule.kind == "string-or-object":
        return {"type": ["string", "object", "null"]}
    if rule.kind == "enum":
        return {"enum": [*rule.choices, None]}
    if rule.kind == "object":
        return {"type": ["object", "null"], "additionalProperties": _ANY}
    if rule.kind == "array":
        return {"type": ["array", "null"], "items": _ANY}
    if rule.kind in _NULLABLE:
        return {"type": [rule.kind, "null"]}
    raise ValueError(f"no schema for field kind {rule.kind!r}")


_BODY_NOTE = (
    "Unknown fields are forwarded to the engine untouched. Every number in the body must fit "
    "an IEEE double (integral values such as 5.0 count as integers); nesting deeper than "
    "`server.max_json_depth` (default 32), more arrays and objects than `server.max_json_containers` "
    "(default 100,000) and bodies over `server.max_body_bytes` are refused."
)


def _request_schema(api: ApiKind, required: dict[str, Schema], description: str) -> Schema:
    properties: dict[str, Schema] = {
        "model": {"type": "string", "minLength": 1},
        **required,
        "stream": {"type": ["boolean", "null"]},
        **{name: _field_schema(rule) for name, rule in FIELD_RULES[api].items()},
    }
    return {
        "type": "object",
        "description": f"{description} {_BODY_NOTE}",
        "required": ["model", *required],
        "properties": properties,
        "additionalProperties": _ANY,
    }


_CONTENT_PART: Schema = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "additionalProperties": _ANY,
        },
        {
            "type": "object",
            "description": "image_url, input_audio, file, …: passed through",
            "required": ["type"],
            "properties": {"type": {"type": "string", "not": {"const": "text"}}},
            "additionalProperties": _ANY,
        },
    ]
}
_CHAT_MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": ref("ContentPart")}, {"type": "null"}]
        },
        "name": {"type": ["string", "null"]},
        "tool_calls": {"type": ["array", "null"], "items": _ANY},
    },
    "additionalProperties": _ANY,
}


# ---- responses ------------------------------------------------------------------------------

_ERROR: Schema = {
    "type": "object",
    "description": (
        "OpenAI error body. Errors the gateway makes itself carry all four fields; an engine's 4xx "
        "body is passed through as the engine wrote it."
    ),
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["string", "integer", "null"]},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE: Schema = {"type": ["object", "null"], "additionalProperties": True}


def _completion_schema(choice: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


_CHAT_COMPLETION = _completion_schema(
    {
        "type": "object",
        "required": ["index", "message"],
        "properties": {
            "index": {"type": "integer"},
            "message": {"type": "object", "properties": {"role": {"type": "string"}}},
            "finish_reason": {"type": ["string", "null"]},
        },
    }
)
_TEXT_COMPLETION = _completion_schema(
    {
        "type": "object",
        "required": ["index", "text"],
        "properties": {
            "index": {"type": "integer"},
            "text": {"type": "string"},
            "finish_reason": {"type": ["string", "null"]},
        },
    }
)
_EMBEDDINGS: Schema = {
    "type": "object",
    "required": ["object", "data", "model"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "embedding"],
                "properties": {
                    "object": {"type": "string"},
                    "index": {"type": "integer"},
                    "embedding": {
                        "anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": _USAGE,
    },
}
_MODEL_LIST: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                },
            },
        },
    },
}
_NULLABLE_NUMBER: Schema = {"type": ["number", "null"]}
ENDPOINT_ROW: Schema = {
    "type": "object",
    "required": ["url", "role", "engine", "models", "healthy", "in_flight"],
    "properties": {
        "url": {"type": "string"},
        "role": {"enum": ["both", "prefill", "decode"]},
        "engine": {"enum": ["vllm", "sglang"]},
        "models": {"type": "array", "items": {"type": "string"}},
        "healthy": {"type": "boolean"},
        "in_flight": {"type": "integer"},
        "in_flight_tokens": {"type": "integer"},
        "waiting": _NULLABLE_NUMBER,
        "running": _NULLABLE_NUMBER,
        "kv_usage": _NULLABLE_NUMBER,
        "metrics_stale": {"type": "boolean"},
        "metrics_age_s": _NULLABLE_NUMBER,
        "source": {"type": ["string", "null"], "description": "config, admin, or a discovery source"},
        "ejected": {"type": "boolean", "description": "out of rotation by the circuit breaker"},
        "breaker": {"enum": ["closed", "open", "half_open"]},
        "draining": {"type": "boolean"},
    },
}

_REQUEST_ID_HEADER: Schema = {
    "description": "The request id: the client's `x-request-id` if printable and short, else generated.",
    "schema": {"type": "string"},
}
_RETRY_AFTER_HEADER: Schema = {
    "description": "Seconds to wait before retrying.",
    "schema": {"type": "string"},
}


def json_content(schema: Schema) -> Schema:
    return {_JSON: {"schema": schema}}


def error_response(description: str, *, retry_after: bool = False) -> Schema:
    headers = {"x-request-id": _REQUEST_ID_HEADER}
    if retry_after:
        headers["Retry-After"] = _RETRY_AFTER_HEADER
    return {"description": description, "headers": headers, "content": json_content(ref("Error"))}


# aiohttp's HTTP parser answers malformed HTTP itself, before any gateway code runs.
HTTP_PARSER_400: Schema = {
    "description": (
        "Malformed HTTP, refused in plain text by the HTTP parser: more than `server.max_headers` "
        "headers, a line or field longer than `server.max_header_bytes`, invalid characters."
    ),
    "content": {"text/plain": {"schema": {"type": "string"}}},
}

INFERENCE_ERRORS: dict[str, Schema] = {
    "400": {
        **error_response("Malformed or invalid request; `param` names the field."),
        "content": {**json_content(ref("Error")), **HTTP_PARSER_400["content"]},
    },
    "401": error_response("Missing or unknown API key (when `auth.enabled`)."),
    "403": error_response("The API key may not use this model or route."),
    "404": error_response("Unknown model (`code: model_not_found`)."),
    "413": error_response("Body larger than `server.max_body_bytes` (`code: request_too_large`)."),
    "429": error_response("Shed by admission control or a tenant's rate limit.", retry_after=True),
    "502": error_response("The chosen engine failed before answering."),
    "503": error_response("No healthy endpoint serves the model.", retry_after=True),
    "504": error_response("The engine did not answer in time."),
}


def _header_param(name: str, description: str, schema: Schema | None = None) -> Schema:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": description,
        "schema": schema or {},
    }


def _case_insensitive(word: str) -> str:
    return "".join(f"[{c.upper()}{c.lower()}]" for c in word)


# What parsing accepts: one of PRIORITIES in any case, surrounding blanks ignored; blank means "standard".
_PRIORITY_PATTERN = r"^\s*(?:" + "|".join(map(_case_insensitive, PRIORITIES)) + r")?\s*$"

_INFERENCE_PARAMS: list[Schema] = [
    _header_param(
        "x-priority",
        f"Admission class: one of {', '.join(PRIORITIES)}, any case; blank means standard "
        "(the header name is `admission.priority_header`).",
        {"type": "string", "pattern": _PRIORITY_PATTERN},
    ),
    _header_param("x-session-id", "Sticky-session key (`sessions.header`).", {"type": "string"}),
    _header_param(
        "x-tenant-id", "Tenant for fairness and limits (`admission.tenant_header`).", {"type": "string"}
    ),
    _header_param(
        "x-request-id", "Propagated request id (at most 128 printable characters).", {"type": "string"}
    ),
    _header_param("x-gateway-debug", "`1`: answer with `x-gateway-scores`.", {"type": "string"}),
]
OPTIONAL_AUTH: list[Schema] = [{}, {"bearerAuth": []}]


_SSE_EVENT: Schema = {
    "type": "object",
    "description": (
        "With `stream: true`, one server-sent event: `data` is a JSON chunk, or `[DONE]` at the end "
        "(an error met mid-stream is sent as a `data` event with an `error` object, then `[DONE]`)."
    ),
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def inference_operation(summary: str, request: str, response: str, *, streams: bool) -> Schema:
    ok_content = json_content(ref(response))
    if streams:
        ok_content["text/event-stream"] = {"schema": _SSE_EVENT}
    ok = {
        "description": "The engine's answer, passed through unchanged.",
        "headers": {
            "x-request-id": _REQUEST_ID_HEADER,
            "x-gateway-endpoint": {"description": "The replica that answered.", "schema": {"type": "string"}},
            "x-gateway-worker": {
                "description": "With `server.workers > 1`: the pid of the worker that served it.",
                "schema": {"type": "string"},
            },
            "x-gateway-model": {
                "description": "When `model` was an alias (config `models:`): the target it was sent to.",
                "schema": {"type": "string"},
            },
        },
        "content": ok_content,
    }
    return {
        "post": {
            "summary": summary,
            "operationId": request[0].lower() + request[1:],
            "security": OPTIONAL_AUTH,
            "parameters": _INFERENCE_PARAMS,
            "requestBody": {"required": True, "content": json_content(ref(request))},
            "responses": {"200": ok, **INFERENCE_ERRORS},
        }
    }


def get_operation(summary: str, operation_id: str, responses: dict[str, Schema], **extra: Any) -> Schema:
    responses = {**responses, "400": HTTP_PARSER_400}
    return {"get": {"summary": summary, "operationId": operation_id, "responses": responses, **extra}}


def ok(description: str, content: Schema) -> Schema:
    return {"description": description, "headers": {"x-request-id": _REQUEST_ID_HEADER}, "content": content}


READY: Schema = {
    "type": "object",
    "required": ["ready"],
    "properties": {"ready": {"type": "boolean"}, "healthy_endpoints": {"type": "integer"}},
}


def components() -> Schema:
    return {
        "schemas": {
            "ChatCompletionRequest": _request_schema(
                ApiKind.CHAT,
                {"messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")}},
                "OpenAI chat completion request.",
            ),
            "CompletionRequest": _request_schema(
                ApiKind.COMPLETIONS, {"prompt": _TEXT_OR_TOKENS}, "OpenAI (legacy) completion request."
            ),
            "EmbeddingRequest": _request_schema(
                ApiKind.EMBEDDINGS,
                {"input": _TEXT_OR_TOKENS},
                "OpenAI embeddings request (`stream` is validated, then ignored).",
            ),
            "ChatMessage": _CHAT_MESSAGE,
            "ContentPart": _CONTENT_PART,
            "ChatCompletion": _CHAT_COMPLETION,
            "Completion": _TEXT_COMPLETION,
            "EmbeddingList": _EMBEDDINGS,
            "ModelList": _MODEL_LIST,
            "JsonValue": _JSON_VALUE,
            "Error": _ERROR,
        },
        "securitySchemes": {
            "adminKey": {
                "type": "http",
                "scheme": "bearer",
                "description": "The admin key whose SHA-256 is `auth.admin_key_sha256` (or x-admin-key).",
            },
            "bearerAuth": {
                "type": "http",
                "scheme": "bearer",
                "description": "API key, required only when `auth.enabled` is true.",
            },
        },
    }
