"""An HTTP/1.1 response without Content-Length or chunked encoding ends when the server
closes the connection (RFC 9112 §6.3): that close completes the body.

Regression: the upstream client read the close as a broken connection, so such a
response became a 502 when not streaming, and a stream got an error event after the
upstream's own ``[DONE]`` and counted a breaker failure.
"""

from __future__ import annotations

import contextlib
import json

from tests.fleet.servers import running_raw
from tests.support.harness import chat_body, gateway_metrics, metric_value

_HEAD = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: %s\r\n\r\n"


def _event(text: str) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny"}
    chunk["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def test_close_delimited_json_response_is_complete(
    stack: contextlib.AsyncExitStack, start_gateway, http
):
    answer = {"id": "c1", "object": "chat.completion", "model": "tiny", "choices": []}
    body = json.dumps(answer).encode()
    raw = await stack.enter_async_context(running_raw([_HEAD % b"application/json", body[:10], body[10:]]))
    gw = await start_gateway([{"url": raw.url, "models": ["tiny"]}], scrape={"enabled": False})
    for _ in range(2):  # and the next request gets a fresh connection
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.json() == answer
    assert raw.posts == 2


async def test_close_delimited_stream_ends_cleanly(stack: contextlib.AsyncExitStack, start_gateway, http):
    parts = [_HEAD % b"text/event-stream", _event("hi"), _event(" there"), b"data: [DONE]\n\n"]
    raw = await stack.enter_async_context(running_raw(parts))
    gw = await start_gateway([{"url": raw.url, "models": ["tiny"]}], scrape={"enabled": False})
    for _ in range(3):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        assert text.endswith("data: [DONE]\n\n") and text.count("data: [DONE]") == 1
        assert '"error"' not in text and "hi" in text and " there" in text
    endpoint = next(iter(gw.state.registry))
    assert endpoint.healthy and not endpoint.ejected
    assert gw.state.breakers.state(endpoint).value == "closed"
    metrics = await gateway_metrics(http, gw)
    assert metric_value(metrics, "llm_gateway_upstream_errors_total") is None
