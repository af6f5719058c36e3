"""Client connections: aiohttp's connection protocol with the limits it lacks.

aiohttp closes a connection idle *between* requests (``keepalive_timeout``) and nothing
else: a client that connects and sends nothing, sends its headers a byte at a time, or
trickles its body holds a socket for as long as it likes, and enough of them exhaust the
process's file descriptors (then ``accept`` fails and even ``/ready`` is unreachable).
:class:`GuardedRunner` serves the app with :class:`_GuardedRequestHandler`, which adds
header and body deadlines and a cap on open connections (:class:`ClientGuard`), and
answers requests aiohttp cannot parse in the gateway's error format.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
import time
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.errors import error_body, error_format, error_response
from gateway.http.middleware import RequestBodyTimeout

__all__ = ["ClientGuard", "GuardedRunner", "connection_cap"]

log = logging.getLogger(__name__)


class ClientGuard:
    """Per-connection limits aiohttp does not have: header and body deadlines, a connection cap.

    aiohttp closes a connection idle *between* requests after ``keepalive_timeout``, but a
    client that sends its headers one byte at a time, or nothing at all after connecting,
    holds the socket until that much longer timer (and the default is an hour), and a
    body trickled while the handler reads it has no deadline at all. One timer per
    connection: the header deadline is armed when a request's first byte is due (at
    accept, and at its first byte after a keep-alive idle) and cancelled when the headers
    are parsed; the body deadline then runs until the body's end. At the header deadline
    the connection is closed; at the body deadline the body stream fails with
    :class:`~gateway.http.middleware.RequestBodyTimeout`, which the middleware answers 408.
    Nothing limits a response: a long stream is never cut by these.

    ``max_connections`` bounds open client sockets per process below the file-descriptor
    limit: past it a new connection gets an immediate 503 and is closed, so the process
    never runs out of descriptors (which makes ``accept`` fail and ``/ready`` unreachable,
    and breaks upstream connects).
    """

    def __init__(self, header_timeout_s: float, body_timeout_s: float, max_connections: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections
        self.open = 0
        self.refused = 0
        self._warned_at = -_REFUSAL_LOG_INTERVAL_S

    def note_refused(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= _REFUSAL_LOG_INTERVAL_S:
            self._warned_at = now
            log.warning(
                "%d client connections open (server.max_connections): refusing new ones (%d so far)",
                self.open,
                self.refused,
            )


_REFUSAL_LOG_INTERVAL_S = 10.0
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)


def _busy_response() -> bytes:
    body = json.dumps(
        error_body("too many open connections to the gateway", "service_unavailable", "too_many_connections")
    ).encode()
    return _BUSY % (len(body), body)


def connection_cap(configured: int) -> int:
    """``server.max_connections``, or with 0 three quarters of the descriptor limit (the rest
    is for upstream connections, Redis, logs and the listener)."""
    if configured > 0:
        return configured
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft * 3 // 4)


class _GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol plus :class:`ClientGuard` and OpenAI-style 4xx bodies."""

    def __init__(self, manager: web.Server, guard: ClientGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._timer: asyncio.TimerHandle | None = None  # the header or the body deadline
        self._counted = False
        self._half_close = False  # send FIN right after the current response (end_after_response)
        self._head_path: str | None = None  # of the request whose headers are arriving

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if guard.open >= guard.max_connections:
            guard.note_refused()
            writable = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
            writable.write(_busy_response())
            writable.close()  # never handed to aiohttp: no task, no parser work
            return
        guard.open += 1
        self._counted = True
        super().connection_made(transport)
        self._arm(guard.header_timeout_s, self._header_timeout)  # the first request's headers are due

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._guard.open -= 1
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if self._timer is None and self._waiter is not None:
            self._arm(self._guard.header_timeout_s, self._header_timeout)  # a keep-alive request began
            self._head_path = None
        waiting_for_headers = not self._messages
        if waiting_for_headers and self._head_path is None:  # the request line's path, for handle_error
            self._head_path = _request_path(data)
        super().data_received(data)
        if waiting_for_headers and self._messages:  # headers parsed: now the body's deadline
            self._cancel_timer()
            message, payload = self._messages[-1]
            if isinstance(message, RawRequestMessage) and not payload.is_eof():
                self._arm(self._guard.body_timeout_s, functools.partial(self._body_timeout, payload))
                payload.on_eof(self._cancel_timer)

    def end_after_response(self) -> None:
        """Close once the current response is written, without lingering to drain the body."""
        self._lingering_time = 0.0
        self._half_close = True

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """After an answer that ends the connection while the client may still be sending (a
        408 to a trickled body): send FIN right behind it. Closing a socket with unread input
        makes the kernel reset the connection, and a client then reads the answer followed by
        ``ECONNRESET`` instead of the end of the stream; with the FIN first it sees the end."""
        answer = await super().finish_response(request, resp, start_time)
        transport = self.transport
        if self._half_close and transport is not None and transport.can_write_eof():
            self._half_close = False
            transport.write_eof()
        return answer

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(delay_s, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if self._waiter is not None and not self._waiter.done() and not self._messages:
            log.debug("client %s: no complete request headers in time; closing", self.peername)
            self.force_close()

    def _body_timeout(self, payload: StreamReader) -> None:
        self._timer = None
        # Only while a handler reads it: a body nobody reads is drained by aiohttp's own
        # lingering close (bounded by lingering_time), which must not meet an error.
        if self._request_in_progress and not payload.is_eof():
            timeout_s = self._guard.body_timeout_s
            payload.set_exception(
                RequestBodyTimeout(f"the request body did not arrive within {timeout_s:g} s")
            )

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """A broken body nobody read (a 404, or an admin call refused before its body) fails
        again in aiohttp's lingering drain after the response, and a client that left makes
        a write fail: the client's doing both, so no ERROR traceback; aiohttp closes the
        connection."""
        exc = kw.get("exc_info")
        if isinstance(exc, (web.RequestPayloadError, RequestBodyTimeout)):
            log.info("client %s: unread request body: %s", self.peername, " ".join(str(exc).split()))
            return
        if isinstance(exc, ConnectionResetError):
            # The client left between two writes of its answer (the middleware logged it and
            # the proxy counted it): ordinary at a load generator's end, no traceback.
            log.debug("client %s: gone mid-answer: %s", self.peername, exc)
            return
        super().log_exception(*args, **kw)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (bad request line or headers, an undecodable
        Content-Encoding): the client's error, answered like every other gateway error and
        logged without a traceback. A 500 keeps aiohttp's handling (and its traceback)."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, ContentEncodingError):  # e.g. br or zstd without their decoder installed
            text = "the request body's Content-Encoding is not supported (use gzip, deflate or none)"
            code = "invalid_body_encoding"
        else:
            text = f"malformed HTTP request: {getattr(exc, 'message', None) or message or exc}"
            code = "bad_http_request"
        log.info("client %s: %d %s", request.remote, status, text)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot answer a parse error")
        # aiohttp's stand-in request for an unparsable one has path "/": the route's own format
        # comes from the request line as it arrived (an oversized header on /v1/messages)
        fmt = error_format(self._head_path or request.path)
        response = error_response(status, text, "invalid_request_error", code, fmt=fmt)
        response.force_close()
        return response


def _request_path(data: bytes) -> str | None:
    """The path of a request line at the start of ``data`` (``POST /v1/messages HTTP/1.1``)."""
    parts = data[:8192].split(b" ", 2)
    if len(parts) < 3 or not parts[1].startswith(b"/"):
        return None
    return parts[1].split(b"?", 1)[0].decode("latin-1")


class _GuardedServer(web.Server):
    """``web.Server`` whose connections are :class:`_GuardedRequestHandler`."""

    def __init__(self, guard: ClientGuard, handler: Any, protocol_kwargs: dict[str, Any], **kwargs: Any):
        super().__init__(handler, **kwargs, **protocol_kwargs)
        self._guard = guard
        self._protocol_kwargs = protocol_kwargs

    def __call__(self) -> RequestHandler:
        return _GuardedRequestHandler(
            self, self._guard, loop=asyncio.get_running_loop(), **self._protocol_kwargs
        )


class GuardedRunner(web.AppRunner):
    def __init__(self, app: web.Application, guard: ClientGuard, **kwargs: Any) -> None:
        self._guard = guard
        self._protocol_kwargs = {
            k: v for k, v in kwargs.items() if k not in ("handler_cancellation", "shutdown_timeout")
        }
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # freezes the app and runs on_startup
        return _GuardedServer(
            self._guard,
            plain.request_handler,
            self._protocol_kwargs,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
        )
