"""The real ``openai`` client, through the gateway, against real vLLM engines."""

from __future__ import annotations

import pytest

from tests.e2e_vllm.conftest import Fleet
from tests.e2e_vllm.helpers import MODEL

pytestmark = pytest.mark.slow
N = 6  # completion tokens asked for; ignore_eos makes the engine produce exactly that many


@pytest.fixture
async def client(fleet: Fleet, start_gateway, openai_client):
    gw = await start_gateway(fleet.urls, policy="round-robin")
    return openai_client(gw)


async def test_models_lists_the_served_model(client) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_non_streaming(client) -> None:
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        max_tokens=N,
        extra_body={"ignore_eos": True},
    )
    assert resp.object == "chat.completion"
    assert resp.model == MODEL
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == N
    assert resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + N
    assert resp.usage.prompt_tokens_details is not None  # --enable-prompt-tokens-details


async def test_chat_streaming_with_final_usage_chunk(client) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream to me"}],
        max_tokens=N,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert 1 <= len(content) <= N
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == N
    assert len({c.id for c in chunks}) == 1


async def test_completions_non_streaming(client) -> None:
    resp = await client.completions.create(
        model=MODEL, prompt="cache prefix block", max_tokens=N, extra_body={"ignore_eos": True}
    )
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == N


async def test_completions_streaming(client) -> None:
    stream = await client.completions.create(
        model=MODEL,
        prompt="cache prefix block",
        max_tokens=N,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == N


async def test_engine_errors_reach_the_client_as_openai_errors(client) -> None:
    """vLLM's own 400 (max_tokens beyond max_model_len) comes back as a BadRequestError."""
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert "max_model_len" in str(info.value)
