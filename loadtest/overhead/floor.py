"""The floor under the gateway's data path: a proxy that does nothing else, on two servers.

``python -m loadtest.overhead.floor {aiohttp|httptools} --port P --upstream URL``

Both decode the body (msgspec, as the gateway does), forward the client's bytes to one
upstream with the gateway's own keep-alive client (``gateway.proxy.upstream``) and pass the
answer back, streamed chunk by chunk: no routing, admission, hooks, metrics or logging.
``aiohttp`` serves it the way the gateway does (``web.Application``, ``StreamResponse``);
``httptools`` on a raw :class:`asyncio.Protocol` (the lean server issue 17 item 1 asks for:
keep-alive, in-order answers, chunked responses, nothing more). The difference between the
two is what replacing aiohttp could save per request and per chunk; the difference between
the aiohttp floor and the gateway is the gateway's own pipeline. ``loadtest.overhead.ab
--floor`` measures all of them in one interleaved run (``docs/benchmarks.md`` §3).
"""

from __future__ import annotations

import argparse
import asyncio
from collections import deque

import httptools
import msgspec
import uvloop
from aiohttp import web

from gateway.proxy.upstream import UpstreamClient

__all__ = ["main"]

_PATH = "/v1/chat/completions"
_JSON = {"content-type": "application/json"}
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class _Floor:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.client = UpstreamClient(connect_timeout_s=5, limit_per_endpoint=4096)

    async def open(self, raw: bytes):  # type: ignore[no-untyped-def]
        stream = bool(msgspec.json.decode(raw).get("stream"))
        return stream, await self.client.post(self.upstream, _PATH, raw, _JSON)


def _aiohttp_app(floor: _Floor) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        stream, upstream = await floor.open(await request.read())
        if not stream:
            body = await upstream.read()
            upstream.release()
            return web.Response(body=body, headers={"content-type": upstream.content_type})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        while chunk := await upstream.readany():
            await response.write(chunk)
        upstream.release()
        await response.write_eof()
        return response

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post(_PATH, handle)
    app.router.add_get("/ready", ready)
    return app


class _LeanProtocol(asyncio.Protocol):
    """One client connection: requests parsed by httptools, answered one at a time, in order."""

    def __init__(self, floor: _Floor) -> None:
        self._floor = floor
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._body: list[bytes] = []
        self._queue: deque[bytes] = deque()
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._queue.append(b"".join(self._body) if self._parser.get_method() == b"POST" else b"")
        self._body = []
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._task is not None:
            self._task.cancel()

    async def _serve(self) -> None:
        while self._queue and self._transport is not None:
            await self._answer(self._queue.popleft())
        self._task = None

    async def _answer(self, raw: bytes) -> None:
        if not raw:  # GET /ready (anything else GET): the readiness check
            if self._transport is not None:
                self._transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            return
        stream, upstream = await self._floor.open(raw)
        write = self._transport.write if self._transport is not None else None
        try:
            if not stream:
                body = await upstream.read()
                upstream.release()
                if write is not None:
                    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                    write(head % (upstream.content_type.encode(), len(body)) + body)
                return
            if write is not None:
                write(_STREAM_HEAD)
            while chunk := await upstream.readany():
                if write is not None:
                    write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if write is not None:
                write(b"0\r\n\r\n")
        except asyncio.CancelledError:
            upstream.close()
            raise
        upstream.release()


async def _serve(kind: str, port: int, upstream: str) -> None:
    floor = _Floor(upstream)
    if kind == "aiohttp":
        runner = web.AppRunner(_aiohttp_app(floor), access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
    else:
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: _LeanProtocol(floor), "127.0.0.1", port, backlog=2048)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.overhead.floor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("kind", choices=["aiohttp", "httptools"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.kind, args.port, args.upstream))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
