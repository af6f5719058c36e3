"""The response side of :mod:`gateway.proxy.upstream`: what the caller holds while a body
arrives, and the errors the client raises. Separate so the client module stays about
connections and pools; both are re-exported from there."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.proxy.upstream import _Connection

__all__ = [
    "BodySink",
    "ConnectFailed",
    "ConnectionLost",
    "ResponseTooLarge",
    "UpstreamClientError",
    "UpstreamResponse",
]

_HIGH_WATER = 512 * 1024  # buffered body bytes before we stop reading from the socket
_LOW_WATER = 64 * 1024


class BodySink(Protocol):
    """Where :meth:`UpstreamResponse.relay_to` sends a body (:mod:`gateway.proxy.relay`): once
    per socket read, and the end with the bytes that came in its read (``tail``; on a clean end
    only — a broken one gets them fed first), so that they can go out with the end in one write."""

    def feed(self, data: bytes) -> None: ...

    def end(self, error: ConnectionLost | None, tail: bytes) -> None: ...


class UpstreamClientError(Exception):
    pass


class ConnectFailed(UpstreamClientError):
    """The endpoint could not be reached; the request was not sent."""


class ConnectionLost(UpstreamClientError):
    """``before_response``: no response had begun. ``silent``: not a byte came back for the
    request (a close or reset of a connection the server had dropped while idle): only then
    may the client re-send it on a fresh connection to the same endpoint by itself."""

    def __init__(self, message: str, *, before_response: bool, silent: bool = False) -> None:
        super().__init__(message)
        self.before_response = before_response
        self.silent = silent


class ResponseTooLarge(UpstreamClientError):
    """A buffered answer grew past its limit (a broken or hostile replica must not fill memory)."""


class UpstreamResponse:
    """Status and headers of an upstream response, and its body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_on_end",
        "_pending",
        "_sink",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._on_end: asyncio.Semaphore | None = None  # the pool slot this request holds
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: ConnectionLost | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: BodySink | None = None
        self._pending: list[bytes] = []  # for the sink: this read's body parts so far

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream")

    # -- fed by the protocol ----------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._done:  # never after its end (the connection is torn down instead)
            return
        if self._sink is not None:  # delivered once the read is parsed (a chunked body's parts: one call)
            self._pending.append(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _delivered(self) -> None:
        """A socket read was parsed: what it held goes to the sink in one call."""
        if self._pending and self._sink is not None:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            self._sink.feed(data)

    def _finish(self, error: ConnectionLost | None = None) -> None:
        self._done = True
        self._error = error
        sink = self._sink
        if sink is not None:
            tail = b"".join(self._pending)
            self._pending.clear()
            if error is not None and tail:
                sink.feed(tail)
                tail = b""
            sink.end(error, tail)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- consumer API -----------------------------------------------------------------
    async def readany(self) -> bytes:
        """The next body bytes as they arrived (possibly several chunks joined); b"" at the end."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._drain())
        self._buffered -= len(data)
        if self._buffered < _LOW_WATER:
            self._conn.resume_reading()
        return data

    def _drain(self) -> list[bytes]:
        chunks = list(self._chunks)
        self._chunks.clear()
        return chunks

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; :class:`ResponseTooLarge` once it grows past ``limit`` bytes."""
        parts, size = [], 0
        while chunk := await self.readany():
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                raise ResponseTooLarge(f"the upstream's answer is larger than {limit} bytes")
        return b"".join(parts)

    def relay_to(self, sink: BodySink) -> None:
        """From now on the body goes to ``sink`` from the socket's callback, chunk by chunk as
        it arrives, and its end to ``sink.end``: nobody awaits :meth:`readany` per chunk.
        What arrived before is handed over first."""
        self._sink = sink
        data = b"".join(self._drain()) if self._chunks else b""
        self._buffered = 0
        if self._done and self._error is None:
            sink.end(None, data)  # it all came already: it goes out with the end
            return
        if data:
            sink.feed(data)
        self._conn.resume_reading()
        if self._done:
            sink.end(self._error, b"")

    @property
    def ended_cleanly(self) -> bool:
        """The whole body is here (buffered, or handed over): the upstream ended without error."""
        return self._done and self._error is None

    def take_buffered(self) -> bytes:
        """What arrived and nobody read yet (all of the rest, once :attr:`ended_cleanly`)."""
        data = b"".join(self._drain())
        self._buffered = 0
        return data

    def unrelay(self) -> None:
        """Back to :meth:`readany`: nothing more reaches the sink."""
        self._sink = None

    def pause(self) -> None:
        """Stop reading from the socket (the body's consumer is behind)."""
        self._conn.pause_reading()

    def resume(self) -> None:
        self._conn.resume_reading()

    def release(self) -> None:
        """The body was read to the end: keep the connection for the next request if allowed."""
        self._conn.finished(self)
        self._end()

    def close(self) -> None:
        """Abort the connection now (the upstream sees the client go away)."""
        self._conn.abort()
        self._end()

    def _end(self) -> None:
        slot, self._on_end = self._on_end, None
        if slot is not None:
            slot.release()
