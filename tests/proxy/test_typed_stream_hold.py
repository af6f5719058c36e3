"""Messages and Responses streams are held until their first real content event.

As a chat stream is held past its role-only chunk: ``message_start`` (+ an empty
``content_block_start``) and ``response.created`` / ``response.in_progress`` (+ an empty
output item and content part) come before the engine has produced anything, so a replica
that dies right after them (during prefill) is retried on another one, not a broken
stream. After the first content event a failure is mid-stream: a typed ``event: error``
in the route's own format, then the end of the stream (no ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from tests.proxy.hostile.common import raw
from tests.support.harness import gateway_metrics, metric_value

STICKY_HEALTH = {"interval_s": 60, "unhealthy_threshold": 100}
MESSAGES = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}
RESPONSES = {"model": "tiny", "input": "hi", "stream": True}
ROUTES = [("/v1/messages", MESSAGES), ("/v1/responses", RESPONSES)]


def _events(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        data = [line[5:] for line in block.splitlines() if line.startswith("data:")]
        if data:
            out.append(json.loads("".join(data)))
    return out


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize("mode", ["open-then-die", "open-then-end"])
async def test_a_replica_dying_after_the_opening_events_is_retried(
    start_upstream, start_gateway, http, path, body, mode
):
    dying, good = await start_upstream(), await start_upstream()
    dying.mode = mode
    gw = await start_gateway([dying.url, good.url], policy="round-robin", health=STICKY_HEALTH)
    for _ in range(2):  # one of the two lands on the dying replica first
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        assert resp.headers["x-gateway-endpoint"] == good.name
        kinds = [e["type"] for e in _events(text)]
        assert "error" not in kinds
        assert kinds[-1] in ("message_stop", "response.completed")
        assert kinds.count(kinds[0]) == 1  # the dead attempt's opening never reached the client
    assert dying.first_chunk_sent.is_set()
    metrics = await gateway_metrics(http, gw)
    assert metric_value(metrics, "llm_gateway_retries_total", reason="disconnected") == 1


async def test_a_background_response_whose_stream_broke_is_not_sent_again(
    start_upstream, start_gateway, http
):
    """vLLM stores and runs a ``background: true`` response from the start, whatever becomes of
    the connection: re-sent, one client request ran twice and left two stored responses, one
    whose id nobody was told (review finding). The client gets a 502, the replica keeps it."""
    dying, good = await start_upstream(), await start_upstream()
    dying.mode = "open-then-die"
    gw = await start_gateway([dying.url, good.url], policy="round-robin", health=STICKY_HEALTH)
    statuses = []
    for _ in range(2):  # one of the two lands on the dying replica
        async with http.post(gw.url + "/v1/responses", json={**RESPONSES, "background": True}) as resp:
            statuses.append(resp.status)
            if resp.status == 502:
                assert "background response" in (await resp.json())["error"]["message"]
    assert sorted(statuses) == [200, 502]  # old: [200, 200], the broken one re-sent to the good replica
    assert len(dying.requests) == 1 and len(good.requests) == 1


@pytest.mark.parametrize("background", [True, False])
async def test_a_background_response_whose_connection_closed_unanswered_is_not_sent_again(
    start_upstream, start_gateway, http, stack, background
):
    """The replica read the request and closed without a byte of answer: an ordinary request is
    re-sent to the next replica, a background one is not (its engine may be running it)."""
    taken: list[int] = []

    async def close_unanswered(i, reader, writer, body) -> bool:
        taken.append(i)
        return False

    closing = await raw(stack, close_unanswered)
    good = await start_upstream()
    gw = await start_gateway(
        [{"url": closing.url, "models": ["tiny"]}, good.url], policy="round-robin", health=STICKY_HEALTH
    )
    body = {"model": "tiny", "input": "hi", "background": background}
    statuses = []
    for _ in range(2):  # one of the two lands on the closing replica first
        async with http.post(gw.url + "/v1/responses", json=body) as resp:
            statuses.append(resp.status)
    assert len(taken) == 1
    assert sorted(statuses) == ([200, 502] if background else [200, 200])  # old: [200, 200] for both
    assert len(good.requests) == (1 if background else 2)


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_the_opening_is_held_until_content_arrives(start_upstream, start_gateway, http, path, body):
    upstream = await start_upstream()
    upstream.mode = "open-then-gated"
    gw = await start_gateway([upstream.url])

    async def stream() -> str:
        async with http.post(gw.url + path, json=body) as resp:
            return (await resp.read()).decode()

    task = asyncio.create_task(stream())
    await asyncio.wait_for(upstream.first_chunk_sent.wait(), 2)
    await asyncio.sleep(0.2)
    assert not task.done()  # not even the headers went out: still retryable
    upstream.gate.set()
    events = _events(await asyncio.wait_for(task, 5))
    assert events[0]["type"] in ("message_start", "response.created")  # the opening kept, first
    assert events[-1]["type"] in ("message_stop", "response.completed")


async def test_a_responses_stream_held_then_released_records_its_replica(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    upstream.mode = "open-then-gated"
    upstream.gate.set()
    gw = await start_gateway([upstream.url])
    async with http.post(gw.url + "/v1/responses", json=RESPONSES) as resp:
        await resp.read()
    async with http.post(
        gw.url + "/v1/responses", json={"model": "tiny", "input": "on", "previous_response_id": "resp_typed"}
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-endpoint"] == upstream.name


@pytest.mark.parametrize("mode", ["die", "cut-mid-event"])
async def test_a_messages_failure_after_content_is_a_typed_anthropic_error_event(
    start_upstream, start_gateway, http, mode
):
    upstream = await start_upstream()
    upstream.mode = mode
    gw = await start_gateway([upstream.url])
    async with http.post(gw.url + "/v1/messages", json=MESSAGES) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks[-1].startswith("event: error\n")
    error = _events(text)[-1]
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "upstream stream broke" in error["error"]["message"]
    assert [e["type"] for e in _events(text)][:3] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]
    assert "[DONE]" not in text and "event: x" not in text


@pytest.mark.parametrize("mode", ["die", "cut-mid-event"])
async def test_a_responses_failure_after_content_is_a_typed_error_event(
    start_upstream, start_gateway, http, mode
):
    upstream = await start_upstream()
    upstream.mode = mode
    gw = await start_gateway([upstream.url])
    async with http.post(gw.url + "/v1/responses", json=RESPONSES) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks[-1].startswith("event: error\n")
    error = _events(text)[-1]
    assert error == {
        "type": "error",
        "code": "upstream_stream_error",
        "message": error["message"],
        "param": None,
    }
    assert "upstream stream broke" in error["message"]
    assert "[DONE]" not in text and "event: x" not in text


async def test_the_sdks_raise_on_the_typed_error_event(start_upstream, start_gateway, stack):
    upstream = await start_upstream()
    upstream.mode = "die"
    gw = await start_gateway([upstream.url])
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key="test", max_retries=0, timeout=10)
    stack.push_async_callback(claude.close)
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with claude.messages.stream(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            async for _event in stream:
                pass
    assert "upstream stream broke" in str(caught.value)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="test", max_retries=0, timeout=10)
    stack.push_async_callback(client.close)
    # The Responses API's own error event: the SDK yields it (``ResponseErrorEvent``), last.
    events = [event async for event in await client.responses.create(model="tiny", input="hi", stream=True)]
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert kinds[-1] == "error" and events[-1].code == "upstream_stream_error"
    assert "upstream stream broke" in events[-1].message


def test_the_response_id_is_read_from_a_created_event_cut_by_the_head_bound():
    from gateway.sessions.responses import response_id_in

    big = '{"type": "response.created", "response": {"id": "resp_big", "instructions": "' + "x" * 5000
    head = ("event: response.created\ndata: " + big).encode()[:4096]  # the proxy keeps 4096 bytes
    assert response_id_in(head) == "resp_big"


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
async def test_an_opening_of_many_pings_in_pieces_is_held_then_passed_whole(
    stack, start_gateway, http, newline
):
    """Pings (Anthropic's keep-alive) while the engine prefills, each in its own segment and
    some cut inside their blank line: every completed event is checked once, as it completes
    (the whole held buffer used to be re-parsed per read: quadratic in the pings). The first
    content event, cut across reads, releases the stream; nothing is lost or doubled."""

    def event(name: str, data: dict) -> bytes:
        return f"event: {name}{newline}data: {json.dumps(data)}{newline}{newline}".encode()

    opening = event("message_start", {"type": "message_start", "message": {"id": "m1", "content": []}})
    opening += event(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    ping = event("ping", {"type": "ping"})
    delta = event(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
    )
    stop = event("message_stop", {"type": "message_stop"})
    cut = len(newline)  # inside the blank line that ends the event
    pieces = [opening, *([ping] * 150), ping[:-cut], ping[-cut:] + delta[:-cut], delta[-cut:], stop]

    async def script(i, reader, writer, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.001)
        return False

    upstream = await raw(stack, script)
    gw = await start_gateway([{"url": upstream.url, "models": ["tiny"]}], scrape={"enabled": False})
    async with http.post(gw.url + "/v1/messages", json=MESSAGES) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode().replace("\r\n", "\n")
    kinds = [e["type"] for e in _events(text)]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["ping"] * 151,
        "content_block_delta",
        "message_stop",
    ]
