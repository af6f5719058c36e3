"""An upstream cut in the middle of an SSE event: the client's parser sees a clean error.

Regression: the gateway forwarded ``data: {"partial`` and wrote its own ``data: {"error"…``
right after it on the same line, so the ``openai`` client raised ``JSONDecodeError``
instead of ``APIError``. Only whole events reach the client now: the half event is
dropped and the error event follows the last complete one.
"""

from __future__ import annotations

import json

import openai
import pytest


async def test_the_openai_client_gets_an_api_error_not_a_json_error(
    start_upstream, start_gateway, openai_client
):
    upstream = await start_upstream()
    upstream.mode = "cut-mid-event"
    gw = await start_gateway([upstream.url], policy="round-robin")
    client = openai_client(gw)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == ["Hello"]
    assert "upstream stream broke" in str(caught.value)


async def test_the_raw_stream_drops_the_half_event_then_errors_then_done(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    upstream.mode = "cut-mid-event"
    gw = await start_gateway([upstream.url], policy="round-robin")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        text = (await resp.read()).decode()
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    error = json.loads(events[-3].removeprefix("data: "))
    assert error["error"]["code"] == "upstream_stream_error"
    assert json.loads(events[-4].removeprefix("data: "))["choices"][0]["delta"]["content"] == "Hello"
    assert '"choices": [{"par' not in text
