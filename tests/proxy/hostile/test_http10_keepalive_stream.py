"""An HTTP/1.0 client that asks for keep-alive gets its stream as a plain body (HTTP/1.0 has no
chunked encoding), which only the connection's close can end: the gateway closes it after the
stream. Before (found by review, 2026-12-05) it kept the connection open — aiohttp's
``_prepare_headers`` sets a local ``keep_alive = False`` for such a body but never stores it —
and the client waited for an end that never came."""

from __future__ import annotations

import asyncio
import json

from tests.proxy.hostile.common import gateway, raw
from tests.proxy.hostile.raw import sse_event

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def test_an_http_1_0_keep_alive_client_sees_its_stream_end(stack, start_gateway) -> None:
    async def script(i, reader, writer, body):
        writer.write(SSE_HEAD + _chunk(sse_event("first")))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(_chunk(sse_event("second") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    u = await raw(stack, script)
    gw = await gateway(start_gateway, u.url)
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(BODY).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    answer = b""
    try:
        async with asyncio.timeout(5):
            while piece := await reader.read(65536):
                answer += piece
        ended = True
    except TimeoutError:
        ended = False
    writer.transport.abort()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-length" not in head.lower() and b"transfer-encoding" not in head.lower(), head
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    assert ended, "a close-delimited body on a connection kept open: the client never sees its end"
