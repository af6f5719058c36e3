"""One exception tree for the gateway, and the single mapping to HTTP status + OpenAI error body.

Every stage raises a ``GatewayError`` subclass; the middleware turns it into
``{"error": {"message", "type", "code", "param"}}`` with the right status. Nothing
else in the code base decides status codes for gateway-made errors.

The body's *format* is per route (:func:`error_format`): the Anthropic Messages routes
answer ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's error types,
as the Anthropic SDKs parse; every other route the OpenAI body. Same statuses.
"""

from __future__ import annotations

import json
import math
from enum import StrEnum
from typing import Any

from aiohttp import web

__all__ = [
    "GATEWAY_CUT",
    "AuthUnavailable",
    "BadRequest",
    "Conflict",
    "EndpointUnavailable",
    "ErrorFormat",
    "Forbidden",
    "GatewayError",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoHealthyEndpoint",
    "NotFound",
    "PayloadTooLarge",
    "Unauthorized",
    "UpstreamError",
    "UpstreamTimeout",
    "bounded",
    "engine_error_message",
    "error_body",
    "error_format",
    "error_response",
    "quoted",
]

# The cancel message of a handler the gateway itself ends (the shutdown timeout): code that
# sees the CancelledError tells it from a client that went away (aiohttp cancels those bare).
GATEWAY_CUT = "llm-gateway: request ended by the gateway"


class ErrorFormat(StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


_MAX_RETRY_AFTER_S = 86_400
# An error may quote the client's own input (a model name, an id, a form field's name); it is
# never sent back whole: a 15 MB model name came back as a 45 MB 404.
_MAX_MESSAGE_CHARS = 2048
_MAX_PARAM_CHARS = 256


def quoted(value: str) -> str:
    """A client's value as an error message names it: quoted, its start only if it is long."""
    return repr(bounded(value, 120))


def bounded(text: str, limit: int) -> str:
    """``text``, or its start and how long it was: at most ``limit`` characters either way."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}…({len(text)} characters)"


_ANTHROPIC_ROUTES = ("/v1/messages",)  # and everything under it (count_tokens)


def error_format(path: str) -> ErrorFormat:
    """The error body format a route answers in."""
    if path.startswith(_ANTHROPIC_ROUTES):
        return ErrorFormat.ANTHROPIC
    return ErrorFormat.OPENAI


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def _anthropic_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


class GatewayError(Exception):
    """Base of all errors the gateway answers itself."""

    status: int = 500
    error_type: str = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        message = bounded(message, _MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else bounded(param, _MAX_PARAM_CHARS)
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.extra_headers: dict[str, str] = {}  # set by a later stage: the tenant's x-ratelimit-*

    def to_response(
        self, headers: dict[str, str] | None = None, *, fmt: ErrorFormat = ErrorFormat.OPENAI
    ) -> web.Response:
        extra = {**self.extra_headers, **(headers or {})}
        if self.retry_after is not None:  # whole seconds, at least 1, at most a day (never inf/NaN)
            seconds = self.retry_after if math.isfinite(self.retry_after) else _MAX_RETRY_AFTER_S
            extra["Retry-After"] = str(min(_MAX_RETRY_AFTER_S, max(1, round(seconds))))
        return error_response(
            self.status, self.message, self.error_type, self.code, self.param, headers=extra, fmt=fmt
        )


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    error_type = "permission_error"
    code = "model_not_allowed"


class Conflict(GatewayError):
    status = 409
    error_type = "invalid_request_error"
    code = "conflict"


class AuthUnavailable(GatewayError):
    status = 503
    error_type = "server_error"
    code = "auth_unavailable"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class ModelNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NoHealthyEndpoint(GatewayError):
    """No endpoint can take the request right now; the client should retry later."""

    status = 503
    error_type = "service_unavailable"
    code = "no_healthy_endpoint"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs: Any) -> None:
        super().__init__(message, retry_after=retry_after, **kwargs)


class UpstreamError(GatewayError):
    """The chosen replica failed before it sent anything we could pass on."""

    status = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class EndpointUnavailable(UpstreamError):
    """Connection-level failure: refused, reset, DNS. Safe to retry elsewhere."""


class UpstreamTimeout(GatewayError):
    status = 504
    error_type = "timeout_error"
    code = "upstream_timeout"


def error_body(
    message: str, error_type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}


def error_response(
    status: int,
    message: str,
    error_type: str,
    code: str | None = None,
    param: str | None = None,
    *,
    headers: dict[str, str] | None = None,
    fmt: ErrorFormat = ErrorFormat.OPENAI,
) -> web.Response:
    message = bounded(message, _MAX_MESSAGE_CHARS)
    param = None if param is None else bounded(param, _MAX_PARAM_CHARS)
    if fmt is ErrorFormat.ANTHROPIC:
        error = {"type": _anthropic_type(status), "message": message}
        body: dict[str, Any] = {"type": "error", "error": error}
    else:
        body = error_body(message, error_type, code, param)
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=headers,
    )


def engine_error_message(body: bytes) -> str | None:
    """The message of an engine's error answer: OpenAI's ``{"error": {"message": …}}``, or
    vLLM's older ``{"object": "error", "message": …}``; None for any other body."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(answer, dict):
        return None
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        message = answer.get("message")
    return message if isinstance(message, str) else None
