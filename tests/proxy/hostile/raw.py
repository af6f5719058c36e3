"""A scriptable raw-TCP HTTP/1.1 upstream for adversarial proxy tests (real sockets).

GET requests (health, metrics, models) get a small valid 200 with keep-alive. Each POST
calls ``script(index, reader, writer, body)``; the script writes whatever bytes it wants and
returns True to keep serving this connection, False to close it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

Script = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


def chat_json(text: str = "hello", model: str = "tiny", **extra: Any) -> bytes:
    out = {
        "id": "cmpl-raw",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        **extra,
    }
    return json.dumps(out).encode()


def response(body: bytes, status: str = "200 OK", ctype: str = "application/json", extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


def sse_event(text: str) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny"}
    chunk["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def endless_json(mib: int, sent: list[int]):
    """A script: a 200 JSON answer, chunked, 1 MiB a chunk for ``mib`` chunks, then silence
    (never its end); ``sent`` gets each chunk's index once it was taken by the socket."""
    block = b"x" * (1 << 20)

    async def script(i, reader, writer, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            for n in range(mib):
                writer.write(b"%x\r\n%s\r\n" % (len(block), block))
                await writer.drain()
                sent.append(n)
            await asyncio.sleep(30)
        except ConnectionError:
            pass
        return False

    return script


class RawUpstream:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.port = 0
        self.posts = 0
        self.bodies: list[bytes] = []
        self.connections = 0
        self.open_connections = 0
        self.aborted = asyncio.Event()  # a POST's connection closed by the peer while the script ran
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        self.open_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length) if length else b""
                if lines[0].startswith("GET"):
                    if " /v1/models" in lines[0]:
                        payload = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
                        writer.write(response(payload.encode()))
                    else:
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    continue
                index = self.posts
                self.posts += 1
                self.bodies.append(body)
                keep = await self.script(index, reader, writer, body)
                await writer.drain()
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self.open_connections -= 1
            self._tasks.discard(task)
            writer.close()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def running_raw(script: Script) -> AsyncIterator[RawUpstream]:
    server = RawUpstream(script)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def until_closed(reader: asyncio.StreamReader, within_s: float = 30.0) -> bool:
    """Wait until the peer closes (the gateway aborted): True if it did within ``within_s``."""
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
