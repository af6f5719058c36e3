"""SSE streaming through the gateway: no buffering, disconnect propagation, mid-stream failures."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.harness import (
    chat_body,
    completion_body,
    debug_endpoints,
    gateway_metrics,
    metric_value,
    wait_idle,
    wait_until,
)

PATHS = {"chat": ("/v1/chat/completions", chat_body), "completions": ("/v1/completions", completion_body)}


def sse_events(raw: bytes) -> list[Any]:
    """``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    events = []
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


async def read_event(resp: aiohttp.ClientResponse, within_s: float = 2.0) -> Any:
    block = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), within_s)
    return sse_events(block)[0]


@pytest.mark.parametrize("kind", list(PATHS))
async def test_stream_is_not_buffered(kind, start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "gated"
    gw = await start_gateway([up.url])
    path, body = PATHS[kind]
    async with http.post(gw.url + path, json=body(stream=True)) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        first = await read_event(resp)
        # The client holds chunk 1 while the upstream has not even been allowed to send chunk 2.
        assert not up.gate.is_set()
        assert not up.rest_sent.is_set()
        choice = first["choices"][0]
        assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == "Hello"
        up.gate.set()
        rest = sse_events(await asyncio.wait_for(resp.read(), 2.0))
    assert up.rest_sent.is_set()
    assert rest[-1] == "[DONE]"
    assert len(rest) == 4  # three more chunks, then [DONE]
    await wait_idle(http, gw)


async def test_stream_not_buffered_with_openai_client(start_upstream, start_gateway, openai_client):
    up = await start_upstream()
    up.mode = "gated"
    gw = await start_gateway([up.url])
    client = openai_client(gw)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    iterator = stream.__aiter__()
    first = await asyncio.wait_for(iterator.__anext__(), 2.0)
    assert first.choices[0].delta.content == "Hello"
    assert not up.rest_sent.is_set()
    up.gate.set()
    rest = [chunk async for chunk in iterator]
    assert "".join(c.choices[0].delta.content for c in rest) == " from the upstream"


async def test_client_disconnect_mid_stream_cancels_upstream(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "hold"
    gw = await start_gateway([up.url])
    resp = await http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True))
    assert resp.status == 200
    await read_event(resp)
    rows = await debug_endpoints(http, gw)
    assert rows[up.url]["in_flight"] == 1
    gauge = metric_value(
        await gateway_metrics(http, gw), "llm_gateway_endpoint_in_flight_requests", endpoint=up.name
    )
    assert gauge == 1
    assert not up.cancelled.is_set()

    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(up.cancelled.wait(), 1.0)
    await wait_idle(http, gw)


async def test_client_disconnect_before_headers_cancels_upstream(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "hold"
    gw = await start_gateway([up.url])

    async def call() -> None:
        async with http.post(gw.url + "/v1/completions", json=completion_body()) as resp:
            await resp.read()

    task = asyncio.create_task(call())

    async def in_flight() -> bool:
        return (await debug_endpoints(http, gw))[up.url]["in_flight"] == 1

    await wait_until(in_flight, 2.0, "the request to reach the upstream")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(up.cancelled.wait(), 1.0)
    await wait_idle(http, gw)


async def test_client_disconnect_is_counted(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "hold"
    gw = await start_gateway([up.url])
    resp = await http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True))
    await read_event(resp)
    resp.close()
    await asyncio.wait_for(up.cancelled.wait(), 1.0)
    await wait_idle(http, gw)
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_client_disconnects_total") == 1


def _assert_error_then_done(events: list[Any]) -> dict[str, Any]:
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == "upstream_error"
    assert error["code"] == "upstream_stream_error"
    assert "[DONE]" not in events[:-1]
    return error


async def test_upstream_dies_after_first_byte(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "die"
    gw = await start_gateway([up.url])
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        assert resp.status == 200
        events = sse_events(await asyncio.wait_for(resp.read(), 2.0))
    assert events[0]["choices"][0]["delta"]["content"] == "Hello"
    _assert_error_then_done(events)
    assert len(events) == 3
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_upstream_errors_total", endpoint=up.name, kind="mid_stream") == 1
    await wait_idle(http, gw)
    # Still serving.
    up.mode = "ok"
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        assert sse_events(await resp.read())[-1] == "[DONE]"


async def test_simulator_dropping_mid_stream_ends_with_error_event(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([sim.url])
    async with http.post(sim.url + "/admin/fault", json={"mode": "drop", "after_chunks": 2}) as r:
        assert r.status == 200
    body = chat_body("sim-llama", stream=True, max_tokens=20)
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        events = sse_events(await asyncio.wait_for(resp.read(), 2.0))
    _assert_error_then_done(events)
    assert len(events) == 4  # two upstream chunks, the error event, [DONE]
    await wait_idle(http, gw)


async def test_openai_client_sees_mid_stream_failure_as_api_error(
    start_upstream, start_gateway, openai_client
):
    up = await start_upstream()
    up.mode = "die"
    gw = await start_gateway([up.url])
    client = openai_client(gw)
    stream = await client.completions.create(model="tiny", prompt="hi", stream=True)
    received = []
    with pytest.raises(openai.APIError, match="upstream"):
        async with asyncio.timeout(2.0):
            async for chunk in stream:
                received.append(chunk.choices[0].text)
    assert received == ["Hello"]


async def test_a_paced_stream_outlives_its_idle_timeout_and_a_stall_after_it_is_cut(
    start_upstream, start_gateway, http
):
    """Events every 50 ms for 1 s (3× ``idle_s``): the idle limit moves with them (lazily: the
    timer is rearmed about once per ``idle_s / 100``), and the stall after them is cut no
    sooner than ``idle_s`` after the last event."""
    up = await start_upstream()
    up.mode = "paced-then-gated"
    gw = await start_gateway([up.url], timeouts={"idle_s": 0.3})
    body, last_event_at, error_at = b"", 0.0, 0.0
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        async with asyncio.timeout(5.0):
            async for piece in resp.content.iter_any():
                now = asyncio.get_running_loop().time()
                if b'"error"' in piece:
                    error_at = error_at or now
                elif b'"choices"' in piece:
                    last_event_at = now
                body += piece
    events = sse_events(body)
    paced = [e for e in events[1:] if isinstance(e, dict) and "choices" in e]
    assert len(paced) >= 12, len(paced)  # ~20 sent; a limit that did not move would cut at 0.3 s
    assert "idle" in _assert_error_then_done(events)["message"]
    assert error_at - last_event_at >= 0.29, error_at - last_event_at
    await wait_idle(http, gw)


async def test_a_stall_after_half_a_first_event_is_cut_at_idle_not_first_byte(
    start_upstream, start_gateway, http
):
    """The first chunk holds no whole event: the limit goes from ``first_byte_s`` (4 s here) to
    ``idle_s`` all the same (found by review: the lazy rearm only ever pushed a limit out)."""
    up = await start_upstream()
    up.mode = "half-event-then-hold"
    gw = await start_gateway([up.url], timeouts={"idle_s": 0.3, "first_byte_s": 4.0})
    started = asyncio.get_running_loop().time()
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        await asyncio.wait_for(resp.read(), 10.0)
    assert asyncio.get_running_loop().time() - started < 2.0
    await asyncio.wait_for(up.cancelled.wait(), 1.0)
    await wait_idle(http, gw)


async def test_stalled_stream_hits_idle_timeout(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "gated"  # never released: the upstream stalls after chunk 1
    gw = await start_gateway([up.url], timeouts={"idle_s": 0.3})
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        events = sse_events(await asyncio.wait_for(resp.read(), 2.0))
    assert events[0]["choices"][0]["delta"]["content"] == "Hello"
    error = _assert_error_then_done(events)
    assert "idle" in error["message"]
    # The gateway hung up on the stalled upstream so the engine can free the request.
    await asyncio.wait_for(up.cancelled.wait(), 1.0)
    await wait_idle(http, gw)
