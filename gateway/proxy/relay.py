"""A committed stream's bytes, from the upstream socket's callback straight to the client's.

Once a stream's first event is out, the rest of it is pass-through with light accounting.
A read-await-write loop woke the handler's task for every event an engine sends (one per
decode step): a future, a task step and aiohttp's awaited write per event, about half the
gateway's CPU on a paced stream. Here the upstream connection's body callback cuts whole
events, writes them to the client's transport and counts them; the handler's task sleeps
until the stream ends, breaks, stalls or the client stops reading, and nothing wakes it
per event. The idle limit is checked when it would expire (one timer per ``idle_s``), not
rearmed per event. The events that arrive with the upstream's end are not written here: the
handler writes them with the chunked body's terminator, in one write (:meth:`StreamRelay.closing`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp.abc import AbstractStreamWriter

from gateway.proxy.sse import SSEEventBuffer
from gateway.proxy.upstream_response import ConnectionLost, UpstreamResponse
from gateway.request.types import RequestContext

__all__ = ["StreamRelay"]

log = logging.getLogger(__name__)

# Bytes queued on the client's socket before the upstream is paused and the handler waits
# for the client to read (aiohttp's own write path drains past the same amount).
_CLIENT_HIGH_WATER = 0x10000


class StreamRelay:
    """Moves one stream's events; :meth:`run` waits for its end and says how it ended."""

    __slots__ = (
        "_blocked",
        "_chunked",
        "_client_gone",
        "_context",
        "_ended",
        "_error",
        "_events",
        "_loop",
        "_on_first",
        "_tail",
        "_transport",
        "_upstream",
        "_waiter",
        "_writer",
        "last",
        "last_data",
        "previous",
    )

    def __init__(
        self,
        upstream: UpstreamResponse,
        transport: asyncio.Transport,
        writer: AbstractStreamWriter,
        context: RequestContext,
        events: SSEEventBuffer,
        last: bytes,
        on_first: Callable[[], None] | None = None,
    ) -> None:
        """``last``: the events already written (the stream's head); ``on_first``: called
        once the first whole event is written, if the head held none."""
        self._loop = asyncio.get_running_loop()
        self._upstream = upstream
        self._transport = transport
        self._writer = writer
        self._chunked = bool(getattr(writer, "chunked", False))  # an HTTP/1.0 client: raw until close
        self._context = context
        self._events = events
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: ConnectionLost | None = None
        self._blocked = False
        self._client_gone = False
        self._tail = b""
        self.previous = b""
        self.last = last  # the usage object sits in the last chunks of the stream
        self.last_data = self._loop.time()
        self._on_first = on_first

    # -- called by the upstream connection, per chunk -----------------------------------
    def feed(self, data: bytes) -> None:
        self.last_data = self._loop.time()
        chunk = self._events.complete(data)  # only whole events: a cut never leaves half of one
        if not chunk or self._client_gone:
            return
        transport = self._transport
        if transport.is_closing():  # the client went away; its handler is being cancelled
            self._client_gone = True
            self._upstream.pause()
            self._wake()
            return
        framed = b"%x\r\n%b\r\n" % (len(chunk), chunk) if self._chunked else chunk
        transport.write(framed)
        self._writer.output_size += len(framed)
        self._context.streamed_chunks += chunk.count(b"data:")
        self.previous = self.last
        self.last = chunk
        if self._on_first is not None:
            self._first_event()
        if transport.get_write_buffer_size() > _CLIENT_HIGH_WATER:
            self._blocked = True  # the client reads slower than the engine writes
            self._upstream.pause()
            self._wake()

    def _first_event(self) -> None:
        on_first, self._on_first = self._on_first, None
        try:
            on_first()  # type: ignore[misc]
        except Exception:  # in the socket's callback: never let it break the connection
            log.exception("first-byte bookkeeping failed")

    def end(self, error: ConnectionLost | None, tail: bytes) -> None:
        self._ended = True
        self._error = error
        self._tail = tail
        self._wake()

    def closing(self) -> bytes:
        """After a clean end: the stream's last whole events, not yet written (those that came
        with the end), counted as written; the caller writes them with the end of the body,
        and decides what an unterminated rest means (:func:`~gateway.proxy.typed_events.stream_end`)."""
        chunk = self._events.complete(self._tail)
        self._tail = b""
        if chunk:
            self._context.streamed_chunks += chunk.count(b"data:")
            self.previous = self.last
            self.last = chunk
            if self._on_first is not None:
                self._first_event()
        return chunk

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the handler's side ---------------------------------------------------------------
    async def run(self, deadline: float, idle_s: float) -> str | None:
        """Relay until the upstream's end: None when it ended cleanly, else why it failed.

        Raises :class:`ConnectionResetError` when the client went away or read nothing for
        ``idle_s`` while the relay waited on it (its transport is then aborted)."""
        loop = self._loop
        self._upstream.relay_to(self)
        try:
            while True:
                if self._client_gone:
                    raise ConnectionResetError("the client went away mid-stream")
                if self._blocked:  # first: the end may have come in the read that filled the client
                    await self._wait_for_client(deadline, idle_s)
                    continue
                if self._ended:
                    return None if self._error is None else f"upstream stream broke: {self._error}"
                self._waiter = loop.create_future()
                try:
                    async with asyncio.timeout_at(min(self.last_data + idle_s, deadline)):
                        await self._waiter
                except TimeoutError:
                    now = loop.time()
                    if now >= deadline or now >= self.last_data + idle_s:
                        return "upstream stalled: no data within the idle or total timeout"
                finally:
                    self._waiter = None
        finally:
            self._upstream.unrelay()

    async def _wait_for_client(self, deadline: float, idle_s: float) -> None:
        """The client's socket is full: wait for it to read, at most ``idle_s``; the upstream
        stays paused meanwhile, so its silence is not counted against it."""
        try:
            async with asyncio.timeout_at(min(self._loop.time() + idle_s, deadline)):
                await self._writer.drain()
        except TimeoutError:
            self._transport.abort()  # not the upstream's stall: the client stopped reading
            raise ConnectionResetError("the client did not read the stream in time") from None
        self._blocked = False
        self.last_data = self._loop.time()
        self._upstream.resume()
