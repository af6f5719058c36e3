"""Outermost stage: request id, and every error turned into an OpenAI-style JSON body."""

from __future__ import annotations

import logging
import time
import uuid

from aiohttp import web

from gateway.errors import GatewayError, error_response
from gateway.http.state import STATE
from gateway.proxy.forward import STREAM_STARTED

__all__ = ["REQUEST_ID", "error_middleware"]

log = logging.getLogger(__name__)

REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
_MAX_REQUEST_ID = 128

_HTTP_ERRORS = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def _request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id", "")
    if given and len(given) <= _MAX_REQUEST_ID and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    request_id = _request_id(request)
    request[REQUEST_ID] = request_id
    started = time.monotonic()
    try:
        response = await handler(request)
    except GatewayError as exc:
        response = exc.to_response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type, code = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", "http_error"))
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"Unknown path {request.path}"
        elif exc.status == 405:
            message = f"Method {request.method} is not allowed on {request.path}"
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = error_response(exc.status, message, error_type, code, headers=allow)
    except ConnectionResetError:
        # The client went away mid-response; nothing can be sent. Counters were
        # released by the proxy's finally blocks.
        log.info("request %s: client disconnected", request_id)
        raise
    except Exception:
        log.exception("request %s: unhandled error", request_id)
        if request.get(STREAM_STARTED):
            raise  # headers are out: aiohttp closes the connection, the client sees it end

        response = error_response(500, "internal gateway error", "server_error", "internal_error")
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    access_log = request.app[STATE].access_log
    if access_log.enabled:
        access_log.write(request, request_id, response.status, started)
    return response
