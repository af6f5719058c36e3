"""Outermost stage: request id, and every error — an unreadable or too slow request body
included — turned into an OpenAI-style JSON body.

It also keeps the table of in-flight requests that a shutdown uses to end what is still
running when ``server.shutdown_timeout_s`` runs out: streams get an SSE error event and
``data: [DONE]`` instead of a cut connection (see :class:`InFlight`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable

from aiohttp import web

from gateway.errors import GATEWAY_CUT, GatewayError, error_format, error_response
from gateway.http.access_log import INFERENCE_REQUEST
from gateway.http.state import STATE
from gateway.ops.route_metrics import UNMATCHED
from gateway.proxy.forward import STREAM_STARTED
from gateway.proxy.sse import error_event
from gateway.request.types import ApiKind

__all__ = [
    "IN_FLIGHT",
    "REQUEST_ID",
    "InFlight",
    "RequestBodyTimeout",
    "error_middleware",
    "remember_response",
]

log = logging.getLogger(__name__)

REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
_MAX_REQUEST_ID = 128

_HTTP_ERRORS = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}

# The response a handler prepared (headers sent): recorded by the ``on_response_prepare``
# signal, because the proxy builds the stream's response inside its own frames and a
# handler cancelled mid-stream never returns it.
_PREPARED: web.RequestKey[web.StreamResponse] = web.RequestKey("prepared_response", web.StreamResponse)


class InFlight:
    """Requests whose handler is running, so a shutdown can end them with a reason.

    aiohttp's own shutdown, at its timeout, cancels the handler and closes the socket in
    the same breath: a stream just stops (no error event, no ``[DONE]``; curl exit 18).
    :meth:`cut` cancels the handlers first, with a reason; the middleware catches that
    cancellation and writes the final event itself while the connection is still open.
    """

    def __init__(self) -> None:
        self._running: dict[asyncio.Task[object], web.Request] = {}  # aiohttp requests are unhashable

    def __len__(self) -> int:
        return len(self._running)

    def add(self, task: asyncio.Task[object], request: web.Request) -> None:
        self._running[task] = request

    def discard(self, task: asyncio.Task[object]) -> None:
        self._running.pop(task, None)

    @staticmethod
    def reason(request: web.Request) -> str | None:
        return request.get(_CUT_REASON)

    def cut(self, reason: str) -> int:
        """Cancel every running handler, to be ended with ``reason``; how many there were."""
        cut = 0
        for task, request in list(self._running.items()):
            if _CUT_REASON not in request and not task.done():
                request[_CUT_REASON] = reason
                task.cancel(GATEWAY_CUT)
                cut += 1
        return cut


_CUT_REASON: web.RequestKey[str] = web.RequestKey("cut_reason", str)
IN_FLIGHT: web.AppKey[InFlight] = web.AppKey("in_flight_requests", InFlight)


async def remember_response(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` signal: keep the prepared response for :func:`_end_cut`."""
    request[_PREPARED] = response


def _request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id", "")
    if given and len(given) <= _MAX_REQUEST_ID and given.isascii() and given.isprintable():
        return given
    return os.urandom(16).hex()  # 32 hex digits like uuid4().hex, at a fifth of its cost


class RequestBodyTimeout(Exception):
    """Set on a request's body stream when it did not arrive within ``server.body_timeout_s``
    (by the connection protocol, :mod:`gateway.http.server`); the handler's read raises it."""


def _unreadable_body(request: web.Request, exc: Exception) -> web.Response:
    """The body could not be read: too slow (408), or not what its Content-Encoding says (400).

    Both are the client's doing, so no traceback. The connection is closed after the
    answer, without aiohttp's lingering read of the rest: a trickle would go on, and a
    broken encoding would only raise again. A valid gzip or deflate body never gets here:
    aiohttp decodes it and the handler reads plain bytes.
    """
    _end_after_response(request)
    if isinstance(exc, RequestBodyTimeout):
        log.info("request from %s: %s; closing", request.remote, exc)
        response = error_response(
            408, str(exc), "invalid_request_error", "request_timeout", fmt=error_format(request.path)
        )
    else:
        encoding = request.headers.get("content-encoding")
        detail = " ".join(str(exc).split())
        log.info(
            "request from %s: unreadable body (content-encoding %r): %s", request.remote, encoding, detail
        )
        if encoding:
            message = f"the request body could not be decoded with its Content-Encoding {encoding!r}"
        else:
            message = "the request body could not be read (malformed chunked encoding or a short body)"
        response = error_response(
            400, message, "invalid_request_error", "invalid_body_encoding", fmt=error_format(request.path)
        )
    response.force_close()
    return response


def _end_after_response(request: web.Request) -> None:
    """Close once the response is out, without aiohttp's lingering read of the unread body
    (our protocol class, :mod:`gateway.http.server`; apps served otherwise just linger)."""
    end_after_response = getattr(request.protocol, "end_after_response", None)
    if end_after_response is not None:
        end_after_response()


async def _end_cut(request: web.Request, reason: str) -> web.StreamResponse:
    """The handler was cancelled by :meth:`InFlight.cut`: finish the response with ``reason``.

    A stream whose headers are out gets an SSE error event and ``data: [DONE]`` (after a
    blank line, which ends an event the upstream may have left half-written and is
    ignored by SSE parsers otherwise); a request that had not started answering gets 503.
    """
    response = request.get(_PREPARED)
    if response is None or not response.prepared:
        return error_response(
            503, reason, "server_error", "gateway_shutting_down", fmt=error_format(request.path)
        )
    inference = request.get(INFERENCE_REQUEST)  # the stream's own error event (Anthropic, Responses …)
    api = inference.api if inference is not None else ApiKind.CHAT
    event = error_event(
        reason, mid_event=True, api=api, code="gateway_shutting_down", error_type="server_error"
    )
    try:
        await response.write(event)
        await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass  # the client left meanwhile, or the body was already complete
    return response


def _v1_paths(app: web.Application) -> list[str]:
    paths = {r.canonical for r in app.router.resources() if r.canonical.startswith("/v1/")}
    return sorted(paths)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    request_id = _request_id(request)
    request[REQUEST_ID] = request_id
    started = time.monotonic()
    in_flight = request.app.get(IN_FLIGHT)
    task = asyncio.current_task()
    if in_flight is not None and task is not None:
        in_flight.add(task, request)
    try:
        response = await handler(request)
    except (RequestBodyTimeout, web.RequestPayloadError) as exc:
        response = _unreadable_body(request, exc)
    except asyncio.CancelledError:
        reason = InFlight.reason(request)
        if reason is None or task is None:
            raise  # the client went away (handler_cancellation), or the loop is stopping
        task.uncancel()
        log.warning("request %s: ended by the gateway: %s", request_id, reason)
        response = await _end_cut(request, reason)
    except GatewayError as exc:
        response = exc.to_response(fmt=error_format(request.path))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type, code = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", "http_error"))
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"Unknown path {request.path}"
            if request.path.startswith("/v1/"):
                message += "; the supported /v1 paths are " + ", ".join(_v1_paths(request.app))
        elif exc.status == 405:
            message = f"Method {request.method} is not allowed on {request.path}"
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = error_response(
            exc.status, message, error_type, code, headers=allow, fmt=error_format(request.path)
        )
    except ConnectionResetError:
        # The client went away mid-response; nothing can be sent. Counters were
        # released by the proxy's finally blocks.
        log.info("request %s: client disconnected", request_id)
        raise
    except Exception:
        log.exception("request %s: unhandled error", request_id)
        if request.get(STREAM_STARTED):
            raise  # headers are out: aiohttp closes the connection, the client sees it end

        response = error_response(
            500, "internal gateway error", "server_error", "internal_error", fmt=error_format(request.path)
        )
    finally:
        if in_flight is not None and task is not None:
            in_flight.discard(task)
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    state = request.app[STATE]
    if isinstance(response, web.Response) and not response.prepared:
        response = await _send_bounded(request, response, state.config.timeouts.idle_s)
    if state.routes is not None:
        state.routes.observe(_route(request), response.status, time.monotonic() - started)
    access_log = state.access_log
    if access_log.enabled:
        access_log.write(request, request_id, response.status, started)
    return response


_BOUNDED_SEND_BYTES = 1 << 18  # answers past this are written a slice at a time
_SEND_SLICE_BYTES = 1 << 14  # small: each slice's wait is the client's idle time, not its reading speed


async def _send_bounded(request: web.Request, response: web.Response, idle_s: float) -> web.StreamResponse:
    """A big answer (an embeddings batch, up to ``limits.max_response_bytes``) written 16 KiB at
    a time; a client that takes nothing of it for ``timeouts.idle_s`` loses its connection, as
    a stream's does. aiohttp writes a body with no deadline: a client that never read held its
    connection and the whole body in memory for ever. A slow client that keeps reading is never
    cut (a deadline per slice cut one reading 160 KiB/s: a slice can wait on many reads)."""
    body = response.body
    if not isinstance(body, bytes) or len(body) <= _BOUNDED_SEND_BYTES or request.method == "HEAD":
        return response  # the common case: aiohttp writes it, and the socket's buffer takes it
    out = web.StreamResponse(status=response.status, reason=response.reason, headers=response.headers)
    out.content_length = len(body)
    view = memoryview(body)
    try:
        await _unless_idle(request, out.prepare(request), idle_s)
        for start in range(0, len(view), _SEND_SLICE_BYTES):
            await _unless_idle(request, out.write(view[start : start + _SEND_SLICE_BYTES]), idle_s)
        await _unless_idle(request, out.write_eof(), idle_s)
    except TimeoutError:
        log.info("request %s: the client stopped reading its answer", request.get(REQUEST_ID))
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("the client stopped reading its answer") from None
    return out


async def _unless_idle(request: web.Request, write: Awaitable[object], idle_s: float) -> None:
    """Await ``write``; TimeoutError once the client took nothing for ``idle_s`` (the transport's
    buffer did not shrink), however long the write takes while it keeps reading."""
    task = asyncio.ensure_future(write)
    if task.done():
        task.result()
        return
    transport = request.transport
    try:
        while True:
            waiting = transport.get_write_buffer_size() if transport is not None else 0
            done, _ = await asyncio.wait((task,), timeout=idle_s)
            if done:
                task.result()
                return
            if transport is None or transport.get_write_buffer_size() >= waiting:
                raise TimeoutError
    finally:
        task.cancel()


def _route(request: web.Request) -> str:
    """The matched route's pattern (``/v1/responses/{response_id}``), never the raw path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED
