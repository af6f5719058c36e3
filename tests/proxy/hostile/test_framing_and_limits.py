"""Upstreams and clients at the edges of the stream framing, the body size and the deadline.

Each case was found by an adversarial review (2026-12-05) and failed on the code before its fix:
a CRLF-framed chat stream held until its end, an empty 200 stream committed as a success, a
non-streamed answer buffered without bound, a re-send started after the total deadline and
charged to a replica it never reached, and a client that stops reading reported as the
upstream stalling.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

from tests.proxy.hostile.common import gateway, healthy_after, post, raw
from tests.proxy.hostile.raw import chat_json, endless_json, response, sse_event
from tests.support.harness import gateway_metrics, metric_value

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def _chunk(delta: dict, end: bytes) -> bytes:
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + end


def _paced_role_stream(end: bytes, tokens: int = 20, gap_s: float = 0.1):
    """A role-only opening, then ``tokens`` deltas ``gap_s`` apart, events ended by ``end``."""

    async def script(i, reader, writer, body):
        writer.write(SSE_HEAD + _chunk({"role": "assistant", "content": ""}, end))
        await writer.drain()
        try:
            for n in range(tokens):
                await asyncio.sleep(gap_s)
                writer.write(_chunk({"content": f"tok{n} "}, end))
                await writer.drain()
            writer.write(b"data: [DONE]" + end)
        except ConnectionError:
            pass
        return False

    return script


async def _first_token_s(http, gw) -> tuple[float, bytes]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    started, first, data = time.monotonic(), None, b""
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        async for piece in resp.content.iter_any():
            data += piece
            if first is None and b"tok0" in data:
                first = time.monotonic() - started
    assert first is not None, data[:300]
    return first, data


async def test_a_crlf_framed_chat_stream_passes_its_first_token_on_when_it_arrives(
    stack, start_gateway, http
) -> None:
    """sse-starlette (llama-cpp-python's server, among others) ends events with CRLF CRLF: the
    role-only opening must be seen as a whole event, or the stream is held until 16 KB or its end."""
    for end in (b"\n\n", b"\r\n\r\n"):
        u = await raw(stack, _paced_role_stream(end))
        gw = await gateway(start_gateway, u.url)
        first, data = await _first_token_s(http, gw)
        assert first < 0.8, f"{end!r}: the first token reached the client after {first:.2f} s (sent at 0.1 s)"
        assert b"tok19" in data and b"[DONE]" in data
        await healthy_after(http, gw)


async def test_a_crlf_stream_longer_than_first_byte_s_is_no_timeout(stack, start_gateway, http) -> None:
    """The held opening ran under first_byte_s: a healthy 2 s CRLF stream got a 504 at 1 s."""
    u = await raw(stack, _paced_role_stream(b"\r\n\r\n"))
    gw = await gateway(start_gateway, u.url, timeouts={"first_byte_s": 1})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        data = await resp.read()
    assert resp.status == 200 and b"tok19" in data, (resp.status, data[:300])
    text = await gateway_metrics(http, gw)
    assert not metric_value(text, "llm_gateway_upstream_errors_total", kind="timeout")


async def test_an_empty_chat_stream_is_resent_not_passed_on_as_a_success(stack, start_gateway, http) -> None:
    """A 200 event stream that ends before any event: broken, re-sent as the typed APIs' is."""
    empty_200 = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )

    async def empty(i, reader, writer, body):
        writer.write(empty_200)
        return True

    async def good(i, reader, writer, body):
        writer.write(SSE_HEAD + sse_event("hello") + b"data: [DONE]\n\n")
        return False

    bad = await raw(stack, empty)
    ok = await raw(stack, good)
    gw = await gateway(start_gateway, bad.url, ok.url)
    results = [await post(http, gw, stream=True) for _ in range(2)]  # round-robin: one meets `bad` first
    assert bad.posts == 1
    for status, body, headers in results:
        assert status == 200 and b"hello" in body and b"[DONE]" in body, (status, body)
        assert headers["x-gateway-endpoint"] == ok.name
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_retries_total", reason="disconnected") == 1
    await healthy_after(http, gw)


async def test_a_non_streamed_answer_past_max_response_bytes_is_refused(stack, start_gateway, http) -> None:
    """An endless body used to be held whole until first_byte_s (300 s by default): 300 MB here.
    Past ``limits.max_response_bytes`` the upstream is closed and the client gets a 502 at once."""
    sent_mib: list[int] = []
    u = await raw(stack, endless_json(300, sent_mib))
    limits = {"max_response_bytes": 4 << 20}
    gw = await gateway(start_gateway, u.url, timeouts={"first_byte_s": 8}, limits=limits)
    started = time.monotonic()
    status, body, _ = await post(http, gw)
    assert status == 502, (status, body[:200])
    assert time.monotonic() - started < 4.0
    error = json.loads(body)["error"]
    assert "larger than 4194304 bytes" in error["message"], error
    assert len(sent_mib) < 64  # the upstream was cut off, not read to its end
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_upstream_errors_total", kind="too_large") == 1
    await healthy_after(http, gw)


async def test_an_answer_within_max_response_bytes_passes_whole(stack, start_gateway, http) -> None:
    text = "y" * (3 << 20)

    async def big(i, reader, writer, body):
        writer.write(response(chat_json(text)))
        return True

    u = await raw(stack, big)
    gw = await gateway(start_gateway, u.url, limits={"max_response_bytes": 4 << 20})
    status, body, _ = await post(http, gw)
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == text


async def test_no_resend_after_the_total_deadline_and_no_blame_for_the_next_replica(
    stack, start_gateway, http
) -> None:
    """A 503 whose body trickles past the request's deadline: the re-send used to start with no
    time left, time out at once, and charge a timeout (and its breaker) to the healthy replica."""

    async def slow_503(i, reader, writer, body):
        head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        writer.write(head + b"Content-Length: 100\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(3)
        return False

    async def healthy(i, reader, writer, body):
        writer.write(response(chat_json()))
        return True

    bad = await raw(stack, slow_503)
    good = await raw(stack, healthy)
    gw = await gateway(
        start_gateway, bad.url, good.url, timeouts={"total_s": 1}, resilience={"retry_backoff_s": 0.0}
    )
    answers = [await post(http, gw) for _ in range(2)]  # round-robin: one meets `bad` first
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200, 504], answers
    late = next(body for status, body, _ in answers if status == 504)
    assert "total timeout" in json.loads(late)["error"]["message"]
    assert good.posts == 1  # only the request sent to it first; no re-send reached it
    text = await gateway_metrics(http, gw)
    assert not metric_value(text, "llm_gateway_upstream_errors_total", endpoint=good.name, kind="timeout")
    assert metric_value(text, "llm_gateway_endpoint_healthy", endpoint=good.name) == 1


async def _stalled_client(url: str) -> socket.socket:
    """A client that sends a streamed chat request and then never reads (a small receive window)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True})
    sock.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
    )
    return sock


async def test_a_client_that_stops_reading_is_cut_as_gone_not_blamed_on_the_upstream(
    stack, start_gateway, http, caplog
) -> None:
    async def firehose(i, reader, writer, body):
        writer.write(SSE_HEAD)
        event = sse_event("x" * 4000)
        try:
            for _ in range(3000):  # ~12 MB as fast as it is taken, then a clean end
                writer.write(event)
                await writer.drain()
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        except ConnectionError:
            pass
        return False

    u = await raw(stack, firehose)
    gw = await gateway(start_gateway, u.url, timeouts={"idle_s": 1, "total_s": 30})
    socks = [await _stalled_client(gw.url) for _ in range(3)]
    try:

        async def all_cut() -> bool:
            text = await gateway_metrics(http, gw)
            return (metric_value(text, "llm_gateway_client_disconnects_total") or 0) >= 3

        deadline = time.monotonic() + 5.0
        while not await all_cut():
            assert time.monotonic() < deadline, "the stalled clients were never cut"
            await asyncio.sleep(0.1)
        text = await gateway_metrics(http, gw)
        assert metric_value(text, "llm_gateway_client_disconnects_total") == 3
        assert not metric_value(text, "llm_gateway_upstream_errors_total", kind="mid_stream")
        assert not [r for r in caplog.records if "upstream stalled" in r.getMessage()]
        await healthy_after(http, gw)
        assert metric_value(text, "llm_gateway_endpoint_healthy", endpoint=u.name) == 1
    finally:
        for sock in socks:
            sock.close()


async def test_a_client_that_never_reads_a_big_answer_loses_its_connection(
    start_upstream, start_gateway
) -> None:
    """A 32 MB non-streamed answer (an embeddings batch) to a client that never reads: aiohttp
    wrote bodies with no deadline, so the connection and the whole body were held for ever
    (review finding). Now each slice waits ``timeouts.idle_s`` at most, as a stream's events do."""
    upstream = await start_upstream()
    upstream.mode, upstream.status = "status", 200
    upstream.body, upstream.content_type = b'{"data": "' + b"x" * (32 << 20) + b'"}', "application/json"
    gw = await start_gateway([upstream.url], timeouts={"idle_s": 1.0})
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    body = json.dumps({"model": "tiny", "input": "hi"}).encode()
    sock.send(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:
        await asyncio.sleep(4.0)  # never reading, four idle timeouts long
        received = 0
        try:
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5.0):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert 0 < received < 32 << 20, received  # old: the whole body, however late
    finally:
        sock.close()


async def test_a_steady_slow_reader_of_a_big_answer_is_not_cut(start_upstream, start_gateway) -> None:
    """Reading 16 KiB every 0.1 s, never idle for ``idle_s`` (1 s): the whole 4 MB arrives (the
    first bounded writer timed a whole 256 KiB slice, and cut this reader at 2.8 MB)."""
    upstream = await start_upstream()
    upstream.mode, upstream.status = "status", 200
    upstream.body, upstream.content_type = b'{"data": "' + b"x" * (4 << 20) + b'"}', "application/json"
    gw = await start_gateway([upstream.url], timeouts={"idle_s": 1.0})
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 14)
    body = json.dumps({"model": "tiny", "input": "hi"}).encode()
    writer.write(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = 0
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 14), 5.0):
            received += len(chunk)
            if received > len(upstream.body):
                break
            await asyncio.sleep(0.1 * len(chunk) / (1 << 14))  # ~160 KiB/s, never a pause of 1 s
    finally:
        writer.close()
    assert received > len(upstream.body), received  # headers and the whole body


async def test_head_of_a_big_answer_has_no_body(start_upstream, start_gateway) -> None:
    """HEAD /metrics of a 400-endpoint gateway (past 256 KiB): the bounded writer sent the body
    after the headers, which a keep-alive client then read as its next answer."""
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url] + [f"http://127.0.0.1:{10 + i}" for i in range(400)])
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[
            1
        ]
    )
    assert length > 1 << 18  # big enough to be written by the bounded writer
    await reader.readexactly(length)
    writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")  # HEAD's headers
    try:
        after = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5.0)
        assert after.startswith(b"HTTP/1.1 200"), after[:60]  # the next answer, not a body
    finally:
        writer.close()
