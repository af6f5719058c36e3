"""A client that stops reading is cut after ``timeouts.idle_s`` even when the upstream's end
arrives in the same read that filled the client's socket. Found by review of the stream relay
(2026-12-05): the relay returned on the end with the client's socket full, and ``write_eof``
waited on aiohttp's drain with no limit, so neither idle_s nor total_s ended the request, which
held its in-flight count and its upstream connection for as long as the client kept the socket
open."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from tests.proxy.hostile.common import gateway, raw
from tests.proxy.hostile.raw import sse_event
from tests.support.harness import debug_endpoints

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
RCVBUF = 4096


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _events(total: int, tag: str) -> bytes:
    out, n = [], 0
    size = 0
    while size < total:
        event = sse_event(f"{tag}{n:06d}" + "y" * 4000)
        out.append(event)
        size += len(event)
        n += 1
    return b"".join(out)


async def _kernel_capacity() -> int:
    """What loopback's socket buffers take for a peer that reads nothing (SO_RCVBUF 4096)."""
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handle(r, w):
        accepted.set_result(w)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    w = await accepted
    w.write(b"x" * 8_000_000)
    await asyncio.sleep(0.5)
    taken = 8_000_000 - w.transport.get_write_buffer_size()
    w.transport.abort()
    sock.close()
    server.close()
    return taken


async def test_a_client_that_stops_reading_is_cut_even_when_the_upstream_ended(
    stack, start_gateway, http
) -> None:
    capacity = await _kernel_capacity()
    fill = _events(capacity + 32_000, "a")  # the client's socket full, < 64 KiB queued in the gateway
    last = _events(200_000, "b") + b"data: [DONE]\n\n"  # then one read: > 64 KiB more, and the end

    async def script(i, reader, writer, body):
        writer.write(SSE_HEAD + _chunk(sse_event("first")))
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(_chunk(fill))
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.write(_chunk(last) + b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)
        return False

    u = await raw(stack, script)
    gw = await gateway(start_gateway, u.url, timeouts={"idle_s": 2, "total_s": 5})
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    _reader, writer = await asyncio.open_connection(sock=sock)
    payload = json.dumps(BODY).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    writer.transport.pause_reading()  # then never reads: the gateway must let go after idle_s
    started = time.monotonic()
    released = False
    while time.monotonic() - started < 9:  # idle_s 2 and total_s 5 are both past by then
        rows = await debug_endpoints(http, gw)
        if time.monotonic() - started > 1.5 and all(r["in_flight"] == 0 for r in rows.values()):
            released = True
            break
        await asyncio.sleep(0.25)
    writer.transport.abort()
    assert released, "9 s on, the request still holds its stream for a client that reads nothing"
