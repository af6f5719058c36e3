"""Runs the gateway: one process, or several sharing the port through SO_REUSEPORT.

With several workers each process has its own endpoint view, scrapers and in-flight
counts (and its own /metrics); the kernel spreads connections across them.

Signals: SIGTERM/SIGINT start a graceful shutdown — ``/ready`` turns 503 at once,
the listener stays open for ``server.drain_s`` so load balancers notice, then it
closes and in-flight requests (streams included) get up to
``server.shutdown_timeout_s`` to finish; a second signal stops at once. SIGHUP
reloads the config file (also reloaded when its content changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import resource
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.config import ConfigError, GatewayConfig, ServerConfig
from gateway.errors import error_body, error_response
from gateway.http.app import build_app
from gateway.http.middleware import IN_FLIGHT, InFlight, RequestBodyTimeout, remember_response
from gateway.http.reload import ConfigReloader
from gateway.http.state import STATE, GatewayState

__all__ = [
    "ClientGuard",
    "ReloadSource",
    "connection_cap",
    "install_uvloop",
    "serve",
    "shared_worker_config",
    "start_site",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReloadSource:
    """Where the running config came from, so it can be read again."""

    path: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    watch_interval_s: float = 2.0


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


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
        waiting_for_headers = not self._messages
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
        again in aiohttp's lingering drain after the response; that is the client's error
        too, so no ERROR traceback, and aiohttp closes the connection."""
        exc = kw.get("exc_info")
        if isinstance(exc, (web.RequestPayloadError, RequestBodyTimeout)):
            log.info("client %s: unread request body: %s", self.peername, " ".join(str(exc).split()))
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
        response = error_response(status, text, "invalid_request_error", code)
        response.force_close()
        return response


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


class _GuardedRunner(web.AppRunner):
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


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    shutdown_timeout_s: float = 30.0,
    max_header_bytes: int = 8190,
    max_headers: int = 64,
) -> web.AppRunner:
    """Start ``app`` on host:port; ``handler_cancellation`` makes a client disconnect cancel the handler.

    The client timeouts and the connection cap come from the app's ``server`` config
    (``header_timeout_s``, ``body_timeout_s``, ``keepalive_timeout_s``, ``max_connections``),
    so every way of starting the gateway (``serve``, the test harness) applies them.
    """
    server = app[STATE].config.server if STATE in app else ServerConfig()
    guard = ClientGuard(
        server.header_timeout_s, server.body_timeout_s, connection_cap(server.max_connections)
    )
    app[IN_FLIGHT] = InFlight()
    app.on_response_prepare.append(remember_response)
    runner = _GuardedRunner(
        app,
        guard,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        keepalive_timeout=server.keepalive_timeout_s,
        max_line_size=max_header_bytes,
        max_field_size=max_header_bytes,
        max_headers=max_headers,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=2048)
    await site.start()
    return runner


async def _serve_one(config: GatewayConfig, reuse_port: bool, reload: ReloadSource | None) -> None:
    app = build_app(config)
    server = config.server
    runner = await start_site(
        app,
        server.host,
        server.port,
        reuse_port=reuse_port,
        shutdown_timeout_s=server.shutdown_timeout_s,
        max_header_bytes=server.max_header_bytes,
        max_headers=server.max_headers,
    )
    state = app[STATE]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    def on_stop_signal() -> None:
        if stop.is_set():
            log.warning("second stop signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop_signal)
    if reload is not None:
        reloader = ConfigReloader(state, reload.path, reload.overrides)
        loop.add_signal_handler(signal.SIGHUP, reloader.reload_soon)
        tasks.append(asyncio.create_task(reloader.watch(reload.watch_interval_s), name="config-watch"))
    else:  # no file to re-read, but SIGHUP must not kill the process; the keys file still reloads
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload_keys(state))
        if state.auth is not None:
            tasks.append(asyncio.create_task(_watch_keys(state), name="keys-watch"))
    log.info(
        "llm-gateway pid %d listening on http://%s:%d (%d endpoints)",
        os.getpid(),
        server.host,
        server.port,
        len(config.endpoints),
    )
    await stop.wait()
    state.shutting_down = True
    in_flight = sum(e.in_flight for e in state.registry)
    log.info("shutting down: not ready; draining %.1f s (%d requests in flight)", server.drain_s, in_flight)
    await asyncio.sleep(state.config.server.drain_s)
    for task in tasks:
        task.cancel()
    await _stop_site(runner, app[IN_FLIGHT], server.shutdown_timeout_s)
    log.info("stopped")


async def _stop_site(runner: web.AppRunner, in_flight: InFlight, timeout_s: float) -> None:
    """Stop accepting and wait up to ``timeout_s`` for in-flight handlers; then end the rest.

    aiohttp's cleanup waits the same timeout, but what it does then is cancel the handler
    and close the socket at once, so a stream just stops mid-body. Here the handlers still
    running at ``timeout_s`` are cancelled first with a reason: the middleware ends each
    stream with an SSE error event and ``data: [DONE]`` (a request not yet answering gets a
    503), and aiohttp finds them finished. aiohttp's own deadline is later (it starts after
    the listener is closed and rounds up), so ours always comes first.
    """
    cleanup = asyncio.ensure_future(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=timeout_s)
    if not done:
        cut = in_flight.cut(
            f"the gateway is shutting down and this request did not finish within {timeout_s:g} s"
        )
        log.warning("shutdown timeout (%.1f s): ended %d requests still running", timeout_s, cut)
    await cleanup


def _reload_keys(state: GatewayState) -> None:
    if state.auth is None:
        log.info("SIGHUP: started without --config and without auth: nothing to reload")
        return
    try:
        state.auth.reconfigure(state.config.auth)
        log.warning("SIGHUP: API keys reloaded")
    except ConfigError as exc:
        log.error("SIGHUP: keys file rejected, the previous keys stay: %s", exc)


async def _watch_keys(state: GatewayState, interval_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(interval_s)
        state.auth.reload_keys_if_changed()


def _worker_main(config: GatewayConfig, log_level: str, reload: ReloadSource | None) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_one(config, reuse_port=True, reload=reload))


def shared_worker_config(
    config: GatewayConfig, reload: ReloadSource | None
) -> tuple[GatewayConfig, ReloadSource | None]:
    """The config every worker gets: one session-token secret, generated here in the parent.

    Each worker would otherwise draw its own random secret, and a token issued by one
    worker would be rejected by the others (the kernel spreads a client's connections
    across workers). The secret also goes into the reload overrides: a re-read file has
    no secret, and without it every reload would see ``sessions`` "changed".
    """
    if config.sessions.token_secret is not None:
        return config, reload
    secret = secrets.token_hex(32)
    sessions = config.sessions.model_copy(update={"token_secret": secret})
    config = config.model_copy(update={"sessions": sessions})
    if reload is not None:
        overrides = dict(reload.overrides)
        overrides["sessions"] = {**overrides.get("sessions", {}), "token_secret": secret}
        reload = dataclasses.replace(reload, overrides=overrides)
    return config, reload


def serve(config: GatewayConfig, reload: ReloadSource | None = None) -> None:
    if config.server.workers == 1:
        install_uvloop()
        asyncio.run(_serve_one(config, reuse_port=False, reload=reload))
        return
    config, reload = shared_worker_config(config, reload)
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=_worker_main, args=(config, config.log_level, reload), name=f"gateway-worker-{i}"
        )
        for i in range(config.server.workers)
    ]
    for worker in workers:
        worker.start()

    def forward(signum: int, _frame: object) -> None:
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                os.kill(worker.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for worker in workers:
        worker.join()
