"""Small real servers for the fleet tests: an engine with a path prefix, TLS, auth or a
malformed model list, and a raw socket server that answers close-delimited responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.upstreams import vllm_metrics

__all__ = ["Engine", "RawServer", "running_engine", "running_raw", "self_signed"]


def self_signed(directory: Path, cn: str = "engine") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA), made with the openssl CLI."""
    cert, key = directory / f"{cn}.crt", directory / f"{cn}.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={cn}"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=20,
    )
    return cert, key


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok", content_type="text/plain")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=vllm_metrics(), content_type="text/plain")


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Engine:
    """OpenAI-ish engine under ``prefix``; 401 unless ``authorization`` matches ``required_auth``."""

    prefix: str = ""
    models_payload: Any = None  # None: a well-formed list with "tiny"
    required_auth: str | None = None
    seen: list[Seen] = field(default_factory=list)
    transports: list[asyncio.Transport] = field(default_factory=list)
    url: str = ""
    port: int = 0
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        p = self.prefix
        app.router.add_get(p + "/health", _ok)
        app.router.add_get(p + "/v1/models", self._models)
        app.router.add_get(p + "/metrics", _metrics)
        app.router.add_post(p + "/v1/chat/completions", self._chat)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler):
        self.seen.append(
            Seen(request.method, request.path, {k.lower(): v for k, v in request.headers.items()})
        )
        if self.required_auth is not None and request.headers.get("authorization") != self.required_auth:
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        payload = self.models_payload
        if payload is None:
            payload = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        return web.json_response(payload)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.transports.append(request.transport)
        body = await request.json()
        if not body.get("stream"):
            message = {"role": "assistant", "content": "hi there"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return web.json_response(
                {"id": "c1", "object": "chat.completion", "model": "tiny", "choices": [choice]}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("hi", " there"):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny"}
            chunk["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_engine(engine: Engine, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Engine]:
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    engine.runner = runner
    engine.port = runner.addresses[0][1]
    scheme = "https" if ssl_context is not None else "http"
    engine.url = f"{scheme}://127.0.0.1:{engine.port}{engine.prefix}"
    try:
        yield engine
    finally:
        await runner.cleanup()


class RawServer:
    """Answers GET with a small 200 and POST with ``response`` bytes, then closes the socket.

    ``response`` is written in ``parts`` (a short pause between them) so a streamed body
    really arrives in pieces; the close is the only end of the body.
    """

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.port = 0
        self.posts = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if length:
                await reader.readexactly(length)
            if lines[0].startswith("GET"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            else:
                self.posts += 1
                for index, part in enumerate(self.parts):
                    if index:
                        await asyncio.sleep(0.02)
                    writer.write(part)
                    await writer.drain()
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def running_raw(parts: list[bytes]) -> AsyncIterator[RawServer]:
    server = RawServer(parts)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
