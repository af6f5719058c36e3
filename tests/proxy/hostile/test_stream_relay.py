"""The committed stream's relay (gateway/proxy/relay.py): bytes go from the upstream socket's
callback to the client's transport, so what an awaited write loop did implicitly must hold
explicitly: a slow client holds the engine back (nothing piles up in the gateway), every
byte arrives in order through a pause, a client without chunked encoding gets a plain body,
and a first chunk with half an event still gives one first byte, when the event is whole.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

from tests.proxy.hostile.common import gateway, healthy_after, raw
from tests.proxy.hostile.raw import sse_event
from tests.support.harness import gateway_metrics, metric_value

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}


def _firehose(events: int, size: int, sent: list[int]):
    """``events`` distinct events of ``size`` bytes as fast as the socket takes them, then [DONE];
    ``sent`` gets each event's number once the socket took it."""

    async def script(i, reader, writer, body):
        writer.write(SSE_HEAD)
        try:
            for n in range(events):
                writer.write(sse_event(f"{n:06d}" + "x" * size))
                await writer.drain()
                sent.append(n)
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        except ConnectionError:
            pass
        return False

    return script


async def _raw_post(url: str, version: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streamed chat request over a plain socket, in the given HTTP version."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(BODY).encode()
    writer.write(
        b"POST /v1/chat/completions %s\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (version, len(payload), payload)
    )
    return reader, writer


def _numbers(data: bytes) -> list[int]:
    out = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: {"):
            out.append(int(json.loads(event[6:])["choices"][0]["delta"]["content"][:6]))
    return out


async def test_a_slow_client_holds_the_upstream_back_and_gets_every_event_in_order(
    stack, start_gateway, http
) -> None:
    sent: list[int] = []
    u = await raw(stack, _firehose(events=20_000, size=4000, sent=sent))  # ~80 MB
    gw = await gateway(start_gateway, u.url, timeouts={"idle_s": 5, "total_s": 60})
    received = bytearray()
    async with http.post(gw.url + "/v1/chat/completions", json=BODY) as resp:
        assert resp.status == 200
        # Read 64 KB, then nothing for a while: the engine may run ahead only by what the
        # sockets' buffers hold (some MB on loopback), not by the whole answer.
        received += await resp.content.readexactly(65536)
        await asyncio.sleep(1.0)
        ahead = len(sent)
        assert ahead < 6000, f"the upstream sent {ahead} of 20000 events to a client that read 16"
        while piece := await resp.content.read(65536):  # then slowly, with pauses
            received += piece
            if len(received) < 4_000_000:
                await asyncio.sleep(0.001)
    assert received.endswith(b"data: [DONE]\n\n")
    assert _numbers(bytes(received)) == list(range(20_000))
    await healthy_after(http, gw)


async def test_an_http_1_0_client_gets_the_stream_as_a_plain_body_until_close(stack, start_gateway) -> None:
    async def paced(i, reader, writer, body):
        writer.write(SSE_HEAD + sse_event("000000first"))
        await writer.drain()
        try:
            for n in range(1, 20):
                await asyncio.sleep(0.01)
                writer.write(sse_event(f"{n:06d}"))
                await writer.drain()
            writer.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass
        return False

    u = await raw(stack, paced)
    gw = await gateway(start_gateway, u.url)
    reader, writer = await _raw_post(gw.url, b"HTTP/1.0")
    answer = await asyncio.wait_for(reader.read(-1), 10.0)  # HTTP/1.0: the close ends the body
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in head.lower()
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    assert _numbers(body) == list(range(20))


async def test_a_first_chunk_of_half_an_event_gives_one_first_byte_when_it_is_whole(
    stack, start_gateway, http
) -> None:
    event = sse_event("000000hello")

    async def half_first(i, reader, writer, body):
        writer.write(SSE_HEAD + event[:20])
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(event[20:] + sse_event("000001"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(sse_event("000002") + b"data: [DONE]\n\n")
        await writer.drain()
        return False

    u = await raw(stack, half_first)
    gw = await gateway(start_gateway, u.url)
    ttft_count = "llm_gateway_time_to_first_byte_seconds_count"
    before = metric_value(await gateway_metrics(http, gw), ttft_count) or 0
    started = time.monotonic()
    async with http.post(gw.url + "/v1/chat/completions", json=BODY) as resp:
        first_at = None
        data = b""
        async for piece in resp.content.iter_any():
            data += piece
            if first_at is None:
                first_at = time.monotonic() - started
    assert _numbers(data) == [0, 1, 2]
    assert first_at is not None and first_at >= 0.25  # never half of the event early
    text = await gateway_metrics(http, gw)
    assert metric_value(text, ttft_count) == before + 1
    assert metric_value(text, "llm_gateway_time_to_first_byte_seconds_sum") >= 0.25
    await healthy_after(http, gw)


async def test_a_client_gone_while_the_upstream_floods_frees_the_upstream(stack, start_gateway, http) -> None:
    sent: list[int] = []
    u = await raw(stack, _firehose(events=100_000, size=1000, sent=sent))
    gw = await gateway(start_gateway, u.url, timeouts={"idle_s": 30, "total_s": 60})
    reader, writer = await _raw_post(gw.url, b"HTTP/1.1")
    assert (await asyncio.wait_for(reader.read(65536), 5)).startswith(b"HTTP/1.1 200")
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()  # a reset, mid-flood
    deadline = time.monotonic() + 5
    while True:
        text = await gateway_metrics(http, gw)
        if metric_value(text, "llm_gateway_client_disconnects_total") == 1:
            break
        assert time.monotonic() < deadline, "the client's reset was never seen"
        await asyncio.sleep(0.05)
    settled = len(sent)
    await asyncio.sleep(0.5)
    assert len(sent) == settled < 100_000, "the upstream is still being read for a client that left"
    assert not metric_value(text, "llm_gateway_upstream_errors_total", kind="mid_stream")
    await healthy_after(http, gw)
