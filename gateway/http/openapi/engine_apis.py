"""OpenAPI paths and schemas of the engines' wider surface: the Responses API (and its
stateful routes), Anthropic Messages, and the pooling/tokenizer routes. Request bodies come
from the parser's field rules, as for chat (:mod:`~gateway.http.openapi.schema`)."""

from __future__ import annotations

from typing import Any

from gateway.http.openapi.schema import (
    HTTP_PARSER_400,
    INFERENCE_ERRORS,
    OPTIONAL_AUTH,
    Schema,
    _request_schema,
    error_response,
    inference_operation,
    json_content,
    ref,
)
from gateway.request.fields import INT32_MAX, INT_MAX, INT_MIN
from gateway.request.types import ApiKind

__all__ = ["engine_components", "engine_paths"]

_ANY_OBJECT: Schema = {"type": "object", "additionalProperties": True}
_INTEGER: Schema = {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX}
_TEXTS: Schema = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
    ]
}
_CONTENT: Schema = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": ref("ContentPart")}, {"type": "null"}]
}
_RESPONSES_ITEM: Schema = {
    "type": "object",
    "description": "A message item (`role`, `content`); other item types (function_call, …) pass through.",
    "required": ["role"],
    "properties": {
        "type": {"const": "message"},
        "role": {"type": "string", "minLength": 1},
        "content": _CONTENT,
    },
    "additionalProperties": ref("JsonValue"),
}
_ANTHROPIC_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": ref("ContentPart")}]},
    },
    "additionalProperties": ref("JsonValue"),
}
_SYSTEM: Schema = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": ref("ContentPart")}, {"type": "null"}]
}
_ANTHROPIC_ERROR: Schema = {
    "type": "object",
    "description": "Anthropic error body, on the /v1/messages routes.",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
_REPLICA_GONE = error_response(
    "The replica that stored the response is unavailable (`code: response_replica_unavailable`)."
)
_CHAIN_CONFLICT = error_response(
    "The replica that stored `previous_response_id` is unavailable (`code:"
    " response_replica_unavailable`), or does not serve the model asked for (`code:"
    " response_replica_lacks_model`)."
)


def _anthropic_errors() -> dict[str, Schema]:
    errors = {}
    for status, response in INFERENCE_ERRORS.items():
        content = json_content(ref("AnthropicError"))
        if status == "400":  # the HTTP parser's refusal comes before the route is known: OpenAI's shape
            either = json_content({"anyOf": [ref("AnthropicError"), ref("Error")]})
            content = {**either, **HTTP_PARSER_400["content"]}
        errors[status] = {**response, "content": content}
    return errors


def _operation(summary: str, request: str, *, streams: bool, anthropic: bool = False) -> Schema:
    operation = inference_operation(summary, request, "EngineAnswer", streams=streams)
    post = operation["post"]
    if anthropic:
        post["responses"] = {"200": post["responses"]["200"], **_anthropic_errors()}
    if request == "ResponsesRequest":
        post["responses"]["409"] = _CHAIN_CONFLICT
    return operation


def _stateful(method: str, summary: str, operation_id: str) -> Schema:
    return {
        method: {
            "summary": summary,
            "operationId": operation_id,
            "security": OPTIONAL_AUTH,
            "parameters": [_RESPONSE_ID],
            "responses": {
                "200": {
                    "description": "The storing replica's answer.",
                    "content": json_content(ref("EngineAnswer")),
                },
                "400": {**INFERENCE_ERRORS["400"]},
                "401": INFERENCE_ERRORS["401"],
                "404": error_response(
                    "No such response for the caller (`code: response_not_found`): unknown, or "
                    "another tenant's (answered alike)."
                ),
                "409": _REPLICA_GONE,
                "default": {
                    "description": "The storing replica's own answer, passed through.",
                    "content": json_content(_ANY_OBJECT),
                },
            },
        }
    }


def engine_paths() -> dict[str, Schema]:
    pooling = "routed to a replica serving the model; the path is passed on as it is"
    paths: dict[str, Schema] = {
        "/v1/responses": _operation(
            "OpenAI Responses API; `previous_response_id` continues on the replica that stored it",
            "ResponsesRequest",
            streams=True,
        ),
        "/v1/responses/{response_id}": {
            **_stateful("get", "A stored response, from the replica that stored it", "getResponse"),
            **_stateful("delete", "Delete a stored response on its replica", "deleteResponse"),
        },
        "/v1/responses/{response_id}/cancel": _stateful(
            "post", "Cancel a background response", "cancelResponse"
        ),
        "/v1/responses/{response_id}/input_items": _stateful(
            "get", "A stored response's input items", "listResponseInputItems"
        ),
        "/v1/messages": _operation("Anthropic Messages API", "MessagesRequest", streams=True, anthropic=True),
        "/v1/messages/count_tokens": _operation(
            "Anthropic token count", "CountTokensRequest", streams=False, anthropic=True
        ),
    }
    for path, request in (
        ("/v1/rerank", "RerankRequest"),
        ("/rerank", "RerankRequest"),
        ("/v2/rerank", "RerankRequest"),
        ("/v1/score", "ScoreRequest"),
        ("/score", "ScoreRequest"),
        ("/classify", "ClassifyRequest"),
        ("/pooling", "PoolingRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ):
        operation = _operation(f"{path}: {pooling}", request, streams=False)
        operation["post"]["operationId"] = "post" + path.replace("/", "_")
        paths[path] = operation
    form_field = "multipart/form-data; `model` is a form field"
    for path, request, summary in (
        ("/v1/audio/transcriptions", "TranscriptionRequest", "Speech to text"),
        ("/v1/audio/translations", "TranslationRequest", "Speech to English text"),
    ):
        streams = request == "TranscriptionRequest"  # stream=true: SSE
        operation = _operation(f"{summary} ({form_field})", request, streams=streams)
        operation["post"]["requestBody"]["content"] = {"multipart/form-data": {"schema": ref(request)}}
        paths[path] = operation
    return paths


def _audio_form(description: str) -> Schema:
    fields: dict[str, Any] = {
        "file": {"type": "string", "contentMediaType": "application/octet-stream"},
        "model": {"type": "string", "minLength": 1},
        "prompt": {"type": "string"},
        "response_format": {"type": "string", "enum": ["json", "text", "srt", "verbose_json", "vtt"]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    }
    if description.startswith("Transcription"):
        fields |= {"language": {"type": "string"}, "stream": {"type": "boolean"}}
    return {"type": "object", "description": description, "required": ["file", "model"], "properties": fields}


def _optional_model(schema: Schema) -> Schema:
    """vLLM's tokenizer routes take no model (or a null one): the gateway's only model then."""
    properties = {**schema["properties"], "model": {"type": ["string", "null"], "minLength": 1}}
    return {**schema, "properties": properties, "required": [r for r in schema["required"] if r != "model"]}


def engine_components() -> dict[str, Any]:
    tokens = {"type": "array", "minItems": 1, "items": _INTEGER}
    return {
        "ResponsesRequest": _request_schema(
            ApiKind.RESPONSES,
            {
                "input": {
                    "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _RESPONSES_ITEM}]
                }
            },
            "OpenAI Responses API request.",
        ),
        "MessagesRequest": _request_schema(
            ApiKind.MESSAGES,
            {
                "max_tokens": {"type": "integer", "minimum": 1, "maximum": INT32_MAX},
                "messages": {"type": "array", "minItems": 1, "items": _ANTHROPIC_MESSAGE},
            },
            "Anthropic Messages request (`system`: a string or text blocks).",
        ),
        "CountTokensRequest": _request_schema(
            ApiKind.COUNT_TOKENS,
            {"messages": {"type": "array", "minItems": 1, "items": _ANTHROPIC_MESSAGE}},
            "Anthropic count_tokens request.",
        ),
        "TranscriptionRequest": _audio_form("Transcription request: the audio file and its form fields."),
        "TranslationRequest": _audio_form("Translation request: the audio file and its form fields."),
        "RerankRequest": _request_schema(
            ApiKind.RERANK,
            {"query": {"type": "string"}, "documents": _TEXTS},
            "Rerank request (vLLM / Jina / Cohere shape).",
        ),
        "ScoreRequest": _request_schema(
            ApiKind.SCORE, {"text_1": _TEXTS, "text_2": _TEXTS}, "Score request (vLLM's text_1 / text_2)."
        ),
        "ClassifyRequest": _request_schema(ApiKind.CLASSIFY, {"input": _TEXTS}, "Classification request."),
        "PoolingRequest": _request_schema(ApiKind.POOLING, {"input": _TEXTS}, "Pooling request."),
        "TokenizeRequest": _optional_model(
            _request_schema(
                ApiKind.TOKENIZE, {"prompt": {"type": "string", "minLength": 1}}, "Tokenize request."
            )
        ),
        "DetokenizeRequest": _optional_model(
            _request_schema(ApiKind.DETOKENIZE, {"tokens": tokens}, "Detokenize request.")
        ),
        "EngineAnswer": {
            "type": "object",
            "description": "The engine's answer, passed through.",
            "additionalProperties": True,
        },
        "AnthropicError": _ANTHROPIC_ERROR,
    }
