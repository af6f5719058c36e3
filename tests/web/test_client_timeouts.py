"""Slow and silent clients (slowloris) cannot hold the gateway's sockets.

Hostile clients are raw asyncio sockets against a real in-process gateway with small
timeouts; each must be disconnected within its timeout (plus slack), while a normal long
SSE stream — longer than every timeout — is not cut.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

TIMEOUTS = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "keepalive_timeout_s": 0.8}
SLACK_S = 1.5  # loop scheduling on a busy 2-core box; the old gateway held these for minutes


async def _open(gw) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gw.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _closed_within(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """Everything the server sent until it closed; fails if it is still open after ``within_s``."""
    received = b""
    async with asyncio.timeout(within_s):
        while chunk := await reader.read(65536):
            received += chunk
    return received


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    """Send ``data`` one byte at a time until the server closes the connection."""
    try:
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(every_s)
    except (ConnectionError, OSError):
        pass


async def test_a_silent_connection_is_closed_at_the_header_timeout(start_upstream, start_gateway):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], server=TIMEOUTS)
    reader, writer = await _open(gw)
    started = asyncio.get_running_loop().time()
    assert await _closed_within(reader, TIMEOUTS["header_timeout_s"] + SLACK_S) == b""
    assert asyncio.get_running_loop().time() - started >= TIMEOUTS["header_timeout_s"] * 0.9
    writer.close()


async def test_headers_trickled_byte_by_byte_are_cut_at_the_header_timeout(start_upstream, start_gateway):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], server=TIMEOUTS)
    reader, writer = await _open(gw)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    sender = asyncio.create_task(_trickle(writer, request, 0.05))  # keeps sending all along
    try:
        assert await _closed_within(reader, TIMEOUTS["header_timeout_s"] + SLACK_S) == b""
    finally:
        sender.cancel()
        writer.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_a_trickled_body_gets_408_at_the_body_timeout(start_upstream, start_gateway, path):
    """In the route's own error format: Anthropic's on the Messages route."""
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], server=TIMEOUTS)
    reader, writer = await _open(gw)
    body = json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 500}]}
    ).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body))
    )
    sender = asyncio.create_task(_trickle(writer, body, 0.05))
    try:
        answer = await _closed_within(reader, TIMEOUTS["body_timeout_s"] + SLACK_S)
    finally:
        sender.cancel()
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(payload)
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    else:
        assert error["error"]["code"] == "request_timeout"
    assert upstream.requests == []


async def test_an_idle_keep_alive_connection_is_closed_at_the_keepalive_timeout(
    start_upstream, start_gateway
):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], server=TIMEOUTS)
    reader, writer = await _open(gw)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(2):
        head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
    )
    await reader.readexactly(length)
    assert await _closed_within(reader, TIMEOUTS["keepalive_timeout_s"] + SLACK_S) == b""
    writer.close()


async def test_past_the_connection_cap_new_clients_get_503_and_health_recovers(start_upstream, start_gateway):
    upstream = await start_upstream()
    cap = 20
    # The silent clients must still hold every slot when the one too many arrives: with 1 s,
    # a slow moment in CI let the first time out first, and the 21st was simply accepted.
    header_timeout_s = 3.0
    gw = await start_gateway(
        [upstream.url], server={**TIMEOUTS, "header_timeout_s": header_timeout_s, "max_connections": cap}
    )
    silent = [await _open(gw) for _ in range(cap)]
    await asyncio.sleep(0.1)  # all accepted
    try:
        reader, writer = await _open(gw)  # one too many: answered at once, not left hanging
        answer = await _closed_within(reader, 1.0)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        # Once the silent ones time out, a fresh client reaches /health and /ready again.
        for silent_reader, _ in silent:
            await _closed_within(silent_reader, header_timeout_s + SLACK_S)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for path in ("/health", "/ready"):
                async with http.get(gw.url + path) as resp:
                    assert resp.status == 200
    finally:
        for _, silent_writer in silent:
            silent_writer.close()


async def test_a_long_stream_outlives_every_client_timeout(start_sim, start_gateway, openai_client):
    """A stream of ~2.5 s against timeouts of 0.5–0.8 s: the timeouts are for reading
    requests, never for writing responses. The real OpenAI SDK reads it to the end."""
    sim = await start_sim(model="m", time_scale=1.0, decode_step_ms=10.0)
    gw = await start_gateway([sim.url], server=TIMEOUTS)
    client = openai_client(gw)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a long story"}], max_tokens=250, stream=True
    )
    started = asyncio.get_running_loop().time()
    finish = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "length"
    assert asyncio.get_running_loop().time() - started > 2 * TIMEOUTS["keepalive_timeout_s"]


def test_the_default_connection_cap_leaves_descriptors_for_upstreams():
    import resource

    from gateway.http.connections import connection_cap

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(123) == 123
    if soft != resource.RLIM_INFINITY:
        assert connection_cap(0) == max(16, soft * 3 // 4) < soft
