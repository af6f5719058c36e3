"""An HTTP/1.1 response without Content-Length or chunked encoding ends when the server
closes the connection (RFC 9112 §6.3): that close completes the body.

Regression: the upstream client read the close as a broken connection, so such a
response became a 502 when not streaming, and a stream got an error event after the
upstream's own ``[DONE]`` and counted a breaker failure.
"""

from __future__ import annotations

import contextlib
import json

import pytest

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


def _typed(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


async def _stream_of(
    stack, start_gateway, http, parts: list[bytes], path: str, body: dict
) -> tuple[str, dict]:
    raw = await stack.enter_async_context(running_raw(parts))
    gw = await start_gateway([{"url": raw.url, "models": ["tiny"]}], scrape={"enabled": False})
    async with http.post(gw.url + path, json=body) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    metrics = await gateway_metrics(http, gw)
    return text, {"errors": metric_value(metrics, "llm_gateway_upstream_errors_total")}


@pytest.mark.parametrize("split", [True, False], ids=["relayed", "one-read"])
async def test_a_close_mid_event_is_a_broken_stream_not_a_half_event(split, stack, start_gateway, http):
    """A close-delimited body that closes in the middle of an event (the replica died): the
    half event is not passed on — an SSE client would drop it, or choke on it — and the
    stream ends with the error event, counted against the replica."""
    half = _event(" there")[:25]
    events = [_event("hi"), half]
    parts = [_HEAD % b"text/event-stream", *(events if split else [b"".join(events)])]
    text, seen = await _stream_of(
        stack, start_gateway, http, parts, "/v1/chat/completions", chat_body(stream=True)
    )
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", text
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]  # each one whole
    assert payloads[0]["choices"][0]["delta"]["content"] == "hi" and "error" in payloads[1], text
    assert "ended in the middle of an event" in text and text.endswith("data: [DONE]\n\n"), text
    assert seen["errors"] == 1


@pytest.mark.parametrize(("event_line", "type_first"), [(True, False), (False, True), (False, False)])
async def test_a_final_event_longer_than_its_chunks_is_still_the_final_event(
    event_line, type_first, stack, start_gateway, http
):
    """``response.completed`` echoes the whole response (instructions, tools, output): 150 KB
    here, in three writes, past what the event buffer holds back, so it is passed on in pieces;
    the stream is whole, however its last event names itself."""
    created = _typed("response.created", {"type": "response.created", "response": {"id": "resp_1"}})
    delta = _typed("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"})
    fields = [("type", "response.completed"), ("response", {"id": "resp_1", "instructions": "i" * 150_000})]
    data = json.dumps(dict(fields if type_first else fields[::-1]))
    done = (b"event: response.completed\n" if event_line else b"") + b"data: " + data.encode() + b"\n\n"
    pieces = [done[:50_000], done[50_000:100_000], done[100_000:]]
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    parts = [head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in (created, delta, *pieces)), b"0\r\n\r\n"]
    body = {"model": "tiny", "input": "hi", "stream": True}
    text, seen = await _stream_of(stack, start_gateway, http, parts, "/v1/responses", body)
    assert "event: error" not in text and text.endswith("}\n\n")
    assert seen["errors"] is None


async def test_a_blank_line_split_after_an_event_passed_on_in_pieces_is_no_cut(stack, start_gateway, http):
    """An event past what the buffer holds back (64 KiB) is passed on as it comes; when the read
    ends inside its closing blank line, the last read holds only a line end: no event was cut."""
    big = _event("x" * 70_000)
    parts = [_HEAD % b"text/event-stream", _event("hi"), big[:-1], big[-1:]]
    text, seen = await _stream_of(
        stack, start_gateway, http, parts, "/v1/chat/completions", chat_body(stream=True)
    )
    assert text.endswith(big.decode()) and '"error"' not in text
    assert seen["errors"] is None
