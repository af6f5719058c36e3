"""A lean HTTP/1.1 keep-alive client for the request hot path: per-endpoint connection pools.

Why not aiohttp's ClientSession here: profiling the proxy against a zero-work upstream
put a quarter of the gateway's CPU in ClientSession's request machinery (cookie jar,
header and URL objects, tracing hooks) that a proxy to a fixed set of model servers
never needs. This client writes one pre-built request, parses the response with
``httptools`` (llhttp, the parser uvicorn uses: chunked decoding, keep-alive rules),
and hands body chunks over as they arrive, with read-side back-pressure.

Contract used by :mod:`gateway.proxy.forward`:

- :class:`ConnectFailed`: nothing reached the endpoint (refused, unreachable, connect
  timeout) — safe to send elsewhere;
- :class:`ConnectionLost`: the connection broke; ``before_response`` tells whether any
  response byte had arrived (if not, the request may be re-sent elsewhere);
- :meth:`UpstreamResponse.close` aborts the socket, which is how a replica learns that a
  client went away and frees the request's KV cache;
- a stale pooled connection that the server closed while idle is retried once on a
  fresh connection, transparently;
- a response with neither ``Content-Length`` nor chunked encoding ends when the server
  closes the connection (RFC 9112 §6.3): that close is its end, not a failure.

The endpoint URL is honoured in full: ``https://`` (TLS with the endpoint's SSL context,
verified by default), a path prefix (``http://host/pfx`` → ``POST /pfx/v1/...``), and
user info, which never reaches the ``Host`` header (the caller sends it as Basic auth).

Health checks and metric scrapes, which are rare, still use aiohttp's client.
"""

from __future__ import annotations

import asyncio
import fcntl
import ssl
import struct
import termios
import time
from collections import deque
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import httptools

from gateway.proxy.upstream_response import (
    ConnectFailed,
    ConnectionLost,
    ResponseTooLarge,
    UpstreamResponse,
)

__all__ = [
    "ConnectFailed",
    "ConnectionLost",
    "ResponseTooLarge",
    "UpstreamClient",
    "UpstreamResponse",
]


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: UpstreamResponse | None = None
        self._headers_ready: asyncio.Future[None] | None = None
        self._header_name = b""
        self._paused = False
        self._complete = False
        self._interim = False  # a 1xx (100 Continue, 103 Early Hints) precedes the final response
        self._received = 0  # bytes of the current request's answer so far
        self._keep_alive = False
        self._until_close = False  # the response's body is delimited by the connection's close
        self._paused_at_end = False  # reading was stopped when (or after) the answer's end was parsed
        self._fd = -1  # the socket, when its kernel buffer tells what is left unread (plain TCP)
        self.closed = False
        self.requests_served = 0
        self.idle_since = time.monotonic()

    # -- asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the Transport interface without subclassing it.
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket") if self._pool.tls is None else None
        self._fd = sock.fileno() if sock is not None else -1  # for unread_bytes: TLS has none to read

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - we never ask for upgrades
            self._fail("unexpected protocol upgrade")
        except httptools.HttpParserError as exc:
            self._fail(f"malformed upstream response: {exc}")
        response = self._response
        if response is not None:
            response._delivered()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        headers_ready = self._headers_ready
        if (
            exc is None
            and self._until_close
            and not self._complete
            and self._response is not None
            and headers_ready is not None
            and headers_ready.done()
        ):
            # llhttp cannot see the end of a close-delimited body (httptools has no
            # feed_eof): the orderly close is that end. A reset (exc set) stays a failure.
            self._complete = True
            self._response._finish()
            return
        self._fail(f"upstream closed the connection{f': {exc}' if exc else ''}", silent=self._received == 0)

    # -- httptools callbacks ----------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._response is None or self._complete:
            # Bytes nobody asked for (on an idle connection, or after the answer's end: a body
            # longer than its Content-Length, a second response). Parsed on, they would become
            # the headers and body of the answer being read: a desync. The connection is done.
            self._fail("unsolicited bytes from the upstream")
            raise httptools.HttpParserError("unsolicited response")

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is not None:
            response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim: the final response follows
            self._interim = True
            response.headers.clear()
            return
        response.status = status
        self._keep_alive = self._parser.should_keep_alive()
        headers = response.headers
        self._until_close = (
            status >= 200
            and status not in (204, 304)
            and "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "").lower()
        )
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._interim:  # the 1xx's own end; the final response is still to come
            self._interim = False
            return
        self._complete = True
        self._paused_at_end = self._paused
        if self._response is not None:
            self._response._finish()

    # -- used by the pool and the response ----------------------------------------------
    def _fail(self, message: str, *, silent: bool = False) -> None:
        response = self._response
        headers_ready = self._headers_ready
        if headers_ready is not None and not headers_ready.done():
            headers_ready.set_exception(ConnectionLost(message, before_response=True, silent=silent))
        elif response is not None and not response._done:
            response._finish(ConnectionLost(message, before_response=False))
        if self._transport is not None and not self.closed:
            self._transport.abort()

    async def send(self, request: bytes) -> UpstreamResponse:
        assert self._transport is not None
        self._complete = False  # one parser per connection: llhttp handles keep-alive sequences
        self._paused_at_end = False
        self._until_close = False
        self._interim = False
        self._received = 0
        response = self._response = UpstreamResponse(self)
        self._headers_ready = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        try:
            await self._headers_ready
        except asyncio.CancelledError:
            self.abort()
            raise
        self.requests_served += 1
        return response

    def pause_reading(self) -> None:
        if not self._paused and self._transport is not None and not self.closed:
            self._paused = True
            self._paused_at_end |= self._complete
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._transport.resume_reading()

    def finished(self, response: UpstreamResponse) -> None:
        if response is not self._response:
            return
        self._response = None
        self._headers_ready = None
        # Through TLS, what came after the end while reading was paused may wait in the SSL layer,
        # delivered only a loop turn later (no kernel check sees it): such a connection is not reused.
        tls_held = self._paused_at_end and self._pool.tls is not None
        if self._complete and self._keep_alive and not self.closed and not tls_held:
            self.resume_reading()
            self.idle_since = time.monotonic()
            self._pool.put(self)
        else:
            self.abort()

    def unread_bytes(self) -> bool:
        """Bytes past its last answer's end wait in the kernel, left there while back pressure
        paused reading: reused, the next request would take them for its answer. The loop reads
        them only on its next poll, which a request runnable in the same turn (or asyncio's pool
        waiter) runs before; one ioctl looks now. Only after an answer that ended paused: else
        they were read as they came (and closed it); on every reuse it cost ~1-2 % of CPU."""
        if not self._paused_at_end or self._fd < 0:
            return False  # TLS: ciphertext in the kernel says nothing (tickets); see finished()
        try:
            waiting = struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return True  # cannot tell: do not reuse
        return waiting > 0

    def abort(self) -> None:
        self._response = None
        if self._transport is not None and not self.closed:
            self.closed = True
            self._transport.abort()
        self._pool.forget(self)


class _Pool:
    """Idle keep-alive connections to one endpoint, bounded in number."""

    def __init__(
        self,
        host: str,
        port: int,
        limit: int,
        idle_timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self._limit = limit
        self._idle_timeout_s = idle_timeout_s
        self._idle: deque[_Connection] = deque()
        self._open: set[_Connection] = set()
        self.slots = asyncio.Semaphore(limit) if limit else None  # requests in progress
        self.waiting = 0  # requests waiting for a slot: the gateway-side queue to this endpoint
        self.retired = False  # the endpoint left the fleet: connections close once their request ends

    def take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # most recently used: least likely closed by the server
            if not conn.closed and now - conn.idle_since < self._idle_timeout_s and not conn.unread_bytes():
                return conn
            conn.abort()
        return None

    async def connect(self, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                if self.tls is None:
                    _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self),
                        self.host,
                        self.port,
                        ssl=self.tls,
                        server_hostname=self.host,
                    )
        except TimeoutError:
            raise ConnectFailed(f"connect to {self.host}:{self.port} timed out after {timeout_s}s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        self._open.add(conn)
        return conn

    def put(self, conn: _Connection) -> None:
        if self.retired:
            conn.abort()
            return
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)

    def retire(self) -> None:
        """Close the idle connections now and every busy one when its request ends.

        Requests already sent to a removed endpoint finish (membership promises it), so
        only what is idle can go at once.
        """
        self.retired = True
        while self._idle:
            self._idle.pop().abort()

    def close(self) -> None:
        for conn in list(self._open) + list(self._idle):
            conn.abort()
        self._idle.clear()
        self._open.clear()


class UpstreamClient:
    """POSTs to model servers over pooled keep-alive connections, one pool per endpoint."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        limit_per_endpoint: int,
        idle_timeout_s: float = 30.0,
        ssl_context_for: Callable[[str], ssl.SSLContext | None] | None = None,
    ):
        """``ssl_context_for(base_url)``: the TLS settings of an https endpoint (its CA); None,
        or no callable, means the system CAs with certificate and host name verified."""
        self._connect_timeout_s = connect_timeout_s
        self._limit = limit_per_endpoint
        self._idle_timeout_s = idle_timeout_s
        self._ssl_context_for = ssl_context_for
        self._default_tls: ssl.SSLContext | None = None
        self._pools: dict[str, _Pool] = {}
        self._prefixes: dict[tuple[str, str], bytes] = {}

    def _tls(self, base_url: str) -> ssl.SSLContext:
        context = self._ssl_context_for(base_url) if self._ssl_context_for is not None else None
        if context is None:
            if self._default_tls is None:
                self._default_tls = ssl.create_default_context()
            context = self._default_tls
        return context

    def _pool(self, base_url: str) -> _Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            if parts.scheme == "http":
                tls, default_port = None, 80
            elif parts.scheme == "https":
                tls, default_port = self._tls(base_url), 443
            else:
                raise ConnectFailed(f"{base_url}: only http:// and https:// endpoints are supported")
            host = parts.hostname or "127.0.0.1"
            pool = _Pool(host, parts.port or default_port, self._limit, self._idle_timeout_s, tls)
            self._pools[base_url] = pool
        return pool

    def _request_prefix(self, base_url: str, path: str) -> bytes:
        key = (base_url, path)
        prefix = self._prefixes.get(key)
        if prefix is None:
            parts = urlsplit(base_url)
            host = parts.netloc.rpartition("@")[2]  # never user info in Host
            target = parts.path.rstrip("/") + path  # the endpoint's path prefix, if any
            prefix = f"POST {target} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")
            self._prefixes[key] = prefix
        return prefix

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        on_slot: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send the request; return once the response status and headers have arrived.

        ``on_slot`` runs once a connection slot is held (waiting in the gateway's own pool
        is not the endpoint's slowness).
        """
        pool = self._pool(base_url)
        head = [self._request_prefix(base_url, path)]
        for name, value in headers.items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        request = b"".join(head) + body
        slot = pool.slots
        if slot is not None:
            if slot.locked():  # every connection busy: this request queues in the gateway
                pool.waiting += 1
                try:
                    await slot.acquire()  # held until the response is released or closed
                finally:
                    pool.waiting -= 1
            else:
                await slot.acquire()
        if on_slot is not None:
            on_slot()
        try:
            response = await self._send(pool, request)
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        response._on_end = slot
        return response

    async def _send(self, pool: _Pool, request: bytes) -> UpstreamResponse:
        conn = pool.take_idle()
        if conn is not None:
            try:
                return await conn.send(request)
            except ConnectionLost as exc:
                if not exc.silent:
                    raise  # it answered (garbage, half an answer): never re-sent here by itself
                # The server closed this idle connection as we reused it: nothing came back,
                # so one fresh connection is the standard remedy.
        conn = await pool.connect(self._connect_timeout_s)
        return await conn.send(request)

    def remove(self, base_url: str) -> None:
        """The endpoint left the fleet: drop its pool (busy connections close when their request ends)."""
        pool = self._pools.pop(base_url, None)
        if pool is not None:
            pool.retire()
        for key in [k for k in self._prefixes if k[0] == base_url]:
            del self._prefixes[key]

    def waiting(self, base_url: str) -> int:
        """Requests waiting for one of the endpoint's pooled connections (all of them busy)."""
        pool = self._pools.get(base_url)
        return pool.waiting if pool is not None else 0

    def has_pool(self, base_url: str) -> bool:
        return base_url in self._pools

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
