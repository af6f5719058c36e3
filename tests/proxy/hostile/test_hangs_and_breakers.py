"""Upstreams that hang, trickle, flap; breakers and the retry budget under them."""

from __future__ import annotations

import asyncio
import json
import time

from tests.proxy.hostile.common import errors, gateway, healthy_after, post, raw
from tests.proxy.hostile.raw import chat_json, response, sse_event, until_closed
from tests.proxy.hostile.test_wire_nonsense import good, openai_error
from tests.support.harness import gateway_metrics, metric_value


async def test_accepts_and_never_answers(stack, start_gateway, http, caplog):
    closed = asyncio.Event()

    async def silent(i, reader, writer, body):
        if await until_closed(reader, 20):
            closed.set()
        return False

    u = await raw(stack, silent)
    gw = await gateway(start_gateway, u.url, timeouts={"first_byte_s": 1})
    status, body, _ = await post(http, gw)
    assert status == 504, body
    openai_error(body)
    await asyncio.wait_for(closed.wait(), 3)
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_stream_event_then_hang_ends_with_error_and_done(stack, start_gateway, http, caplog):
    closed = asyncio.Event()

    async def hang(i, reader, writer, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + sse_event("hi"))
        await writer.drain()
        if await until_closed(reader, 20):
            closed.set()
        return False

    u = await raw(stack, hang)
    gw = await gateway(start_gateway, u.url, timeouts={"idle_s": 1})
    status, body, _ = await post(http, gw, stream=True)
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n") and b'"error"' in body, body
    await asyncio.wait_for(closed.wait(), 3)
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_stream_trickling_one_byte_a_second_is_cut_at_total(stack, start_gateway, http, caplog):
    async def trickle(i, reader, writer, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + sse_event("hi"))
        await writer.drain()
        try:
            for byte in sse_event("slow" * 20):
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.3)
        except ConnectionError:
            pass
        return False

    u = await raw(stack, trickle)
    gw = await gateway(start_gateway, u.url, timeouts={"idle_s": 1, "total_s": 3})
    started = time.monotonic()
    status, body, _ = await post(http, gw, stream=True)
    assert time.monotonic() - started < 5
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n") and b'"error"' in body, body
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_all_replicas_fail_retry_budget_respected(stack, start_gateway, http, caplog):
    async def fail(i, reader, writer, body):
        writer.write(
            response(b'{"error": {"message": "engine dead", "type": "x"}}', "503 Service Unavailable")
        )
        return True

    a = await raw(stack, fail)
    b = await raw(stack, fail)
    res = {
        "retry_budget_ratio": 0.0,
        "retry_budget_min_per_s": 0.1,
        "retry_backoff_s": 0.0,
        "consecutive_failures": 100,
        "min_requests": 1000,
    }
    gw = await gateway(start_gateway, a.url, b.url, resilience=res, limits={"retries": 3})
    for _ in range(5):
        status, body, _ = await post(http, gw)
        assert status == 503, body
        assert b"engine dead" in body
    # 5 requests + a budget of exactly 1 retry (0.1/s over the 10 s window)
    assert a.posts + b.posts == 6, (a.posts, b.posts)
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_retry_budget_exhausted_total") == 4
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_half_open_probe_that_hangs(stack, start_gateway, http, caplog):
    state = {"mode": "fail"}

    async def flaky(i, reader, writer, body):
        if state["mode"] == "fail":
            writer.write(response(b'{"error": {"message": "no", "type": "x"}}', "503 Service Unavailable"))
            return True
        await until_closed(reader, 20)  # the probe hangs
        return False

    a = await raw(stack, flaky)
    g = await raw(stack, good)
    res = {"consecutive_failures": 1, "ejection_s": 0.5, "check_interval_s": 0.05, "retry_backoff_s": 0.0}
    gw = await gateway(start_gateway, a.url, g.url, resilience=res, timeouts={"first_byte_s": 2})
    ep_a = next(e for e in gw.state.registry if e.url == a.url)
    for _ in range(2):
        status, _, _ = await post(http, gw)
        assert status == 200
    assert gw.state.breakers.state(ep_a).value == "open"
    state["mode"] = "hang"
    await asyncio.sleep(0.8)  # half-open now
    assert gw.state.breakers.state(ep_a).value == "half_open"
    results = await asyncio.gather(*(post(http, gw) for _ in range(6)))
    statuses = [s for s, _, _ in results]
    # exactly one request is the probe; it hangs until first_byte_s and is then a timeout
    assert statuses.count(504) <= 1, statuses
    assert a.posts == 2, a.posts  # one failure + one probe
    assert gw.state.breakers.state(ep_a).value == "open"
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_flapping_replica_keeps_serving(stack, start_gateway, http, caplog):
    async def flap(i, reader, writer, body):
        if i % 2:
            writer.write(response(b'{"error": {"message": "no", "type": "x"}}', "500 Internal Server Error"))
        else:
            writer.write(response(chat_json("flap")))
        return True

    a = await raw(stack, flap)
    g = await raw(stack, good)
    gw = await gateway(start_gateway, a.url, g.url, resilience={"retry_backoff_s": 0.0})
    results = await asyncio.gather(*(post(http, gw) for _ in range(30)))
    assert all(s == 200 for s, _, _ in results), [s for s, _, _ in results]
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_client_disconnect_aborts_upstream(stack, start_gateway, http, caplog):
    closed = asyncio.Event()

    async def slow(i, reader, writer, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + sse_event("hi"))
        await writer.drain()
        if await until_closed(reader, 20):
            closed.set()
        return False

    u = await raw(stack, slow)
    gw = await gateway(start_gateway, u.url)
    _host, port = gw.url.rsplit(":", 1)
    r, w = await asyncio.open_connection("127.0.0.1", int(port))
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
    ).encode()
    w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    await w.drain()
    await asyncio.wait_for(r.readuntil(b"\n\n"), 5)
    w.transport.abort()
    await asyncio.wait_for(closed.wait(), 3)
    await healthy_after(http, gw)
    assert not errors(caplog)
