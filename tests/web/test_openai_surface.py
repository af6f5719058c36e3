"""The OpenAI surface through the gateway, driven by the real ``openai.AsyncOpenAI`` client."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.harness import chat_body, wait_until

SIM = "sim-llama"
QWEN = "sim-qwen"


@pytest.fixture
async def fleet(start_sim, start_gateway):
    """Two simulators serving sim-llama behind one gateway."""
    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([s.url for s in sims])
    return gw, {s.url.split("://")[1] for s in sims}


async def test_chat_non_streaming(fleet, openai_client):
    gw, names = fleet
    client = openai_client(gw)
    raw = await client.chat.completions.with_raw_response.create(
        model=SIM, messages=[{"role": "user", "content": "Say hello"}], max_tokens=5
    )
    completion = raw.parse()
    assert raw.headers["x-gateway-endpoint"] in names
    assert completion.object == "chat.completion"
    assert completion.model == SIM
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5


async def test_chat_streaming_with_usage(fleet, openai_client):
    gw, _ = fleet
    client = openai_client(gw)
    stream = await client.chat.completions.create(
        model=SIM,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


async def test_completions_non_streaming(fleet, openai_client):
    gw, _ = fleet
    client = openai_client(gw)
    completion = await client.completions.create(model=SIM, prompt="Once upon a time", max_tokens=3)
    assert completion.object == "text_completion"
    assert completion.choices[0].text
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 3


async def test_completions_streaming_with_usage(fleet, openai_client):
    gw, names = fleet
    client = openai_client(gw)
    raw = await client.completions.with_raw_response.create(
        model=SIM,
        prompt="Once upon a time",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-gateway-endpoint"] in names
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = [chunk async for chunk in raw.parse()]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


async def test_models_is_deduplicated_union_of_healthy_endpoints(
    start_sim, start_upstream, start_gateway, openai_client
):
    sims = [await start_sim(), await start_sim(), await start_sim(model=QWEN)]
    extra = await start_upstream(models=("tiny", QWEN))
    gw = await start_gateway([s.url for s in sims] + [extra.url], health={"interval_s": 0.05})
    client = openai_client(gw)
    models = await client.models.list()
    assert [m.id for m in models.data] == sorted([SIM, QWEN, "tiny"])
    assert all(m.object == "model" for m in models.data)

    # Only healthy endpoints count: "tiny" goes away with its only endpoint, sim-qwen stays.
    extra.healthy = False

    async def tiny_gone() -> bool:
        return [m.id for m in (await client.models.list()).data] == sorted([QWEN, SIM])

    await wait_until(tiny_gone, 3.0, "the unhealthy endpoint's model to leave /v1/models")


async def test_requests_go_only_to_endpoints_serving_the_model(start_sim, start_gateway, http):
    llamas = [await start_sim(), await start_sim()]
    qwen = await start_sim(model=QWEN)
    gw = await start_gateway([s.url for s in [*llamas, qwen]])
    qwen_name = qwen.url.split("://")[1]
    llama_names = {s.url.split("://")[1] for s in llamas}
    for _ in range(6):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(QWEN)) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-endpoint"] == qwen_name
            assert (await resp.json())["model"] == QWEN
        async with http.post(gw.url + "/v1/completions", json={"model": SIM, "prompt": "x"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-endpoint"] in llama_names


async def test_request_id_is_echoed_and_forwarded(start_upstream, start_gateway, http):
    up = await start_upstream()
    gw = await start_gateway([up.url])
    for stream in (False, True):
        rid = f"client-id-{stream}"
        body = chat_body(stream=stream)
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] == rid
            await r.read()
        assert up.requests[-1].headers["x-request-id"] == rid


async def test_request_id_generated_when_absent_or_invalid(start_upstream, start_gateway, http):
    up = await start_upstream()
    gw = await start_gateway([up.url])
    seen = set()
    for headers in ({}, {"x-request-id": "x" * 500}):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=headers) as r:
            assert r.status == 200
            rid = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        assert up.requests[-1].headers["x-request-id"] == rid
        seen.add(rid)
    assert len(seen) == 2
    # Errors the gateway answers itself carry the id too.
    async with http.post(gw.url + "/v1/chat/completions", data=b"{", headers={"x-request-id": "bad-1"}) as r:
        assert r.status == 400
        assert r.headers["x-request-id"] == "bad-1"


async def test_embeddings_pass_through(start_upstream, start_gateway, openai_client):
    up = await start_upstream()
    gw = await start_gateway([up.url])
    client = openai_client(gw)
    raw = await client.embeddings.with_raw_response.create(
        model="tiny", input="hello world", encoding_format="float"
    )
    result = raw.parse()
    assert raw.headers["x-gateway-endpoint"] == up.name
    assert result.data[0].embedding == [0.25, -0.5, 1.0]
    assert up.requests[-1].path == "/v1/embeddings"
    assert up.requests[-1].json["input"] == "hello world"


async def test_request_body_forwarded_byte_for_byte(start_upstream, start_gateway, http):
    up = await start_upstream()
    gw = await start_gateway([up.url])
    raw = b'{ "prompt" : "caf\\u00e9  spaces",\n "model":"tiny", "extra_field": [1, 2.50, null] }'
    async with http.post(
        gw.url + "/v1/completions", data=raw, headers={"content-type": "application/json"}
    ) as r:
        assert r.status == 200
        assert json.loads(await r.read())["model"] == "tiny"
    assert up.requests[-1].raw == raw
    assert up.requests[-1].path == "/v1/completions"
