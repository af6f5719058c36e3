"""The Responses API and Anthropic Messages, with the official SDKs, through the gateway,
against real vLLM engines (``VLLM_ENABLE_RESPONSES_API_STORE=1``: each replica keeps the
responses it made).

Round-robin on purpose: without the gateway's response → replica record, the steps of a
``previous_response_id`` chain would alternate between the two replicas and every second
one would be the other replica's 404.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anthropic
import openai
import pytest

from loadtest.realvllm.fleet import ReplicaOptions, start_replicas, stop_replicas
from tests.e2e_vllm.conftest import NUM_BLOCKS, Fleet
from tests.e2e_vllm.helpers import MODEL

pytestmark = pytest.mark.slow
N = 6  # output tokens asked for
CHAIN = 5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """This file's own two replicas: eager (no compile warm-up: these tests are about the
    protocol, not speed), each with its own response store."""
    options = ReplicaOptions(num_blocks=NUM_BLOCKS, enforce_eager=True)
    replicas = start_replicas(2, options, log_dir=tmp_path_factory.mktemp("vllm-agent-logs"), timeout_s=420)
    try:
        yield Fleet(replicas)
    finally:
        stop_replicas(replicas)


@pytest.fixture
async def gw(fleet: Fleet, start_gateway):
    return await start_gateway(fleet.urls, policy="round-robin")


@pytest.fixture
async def client(gw, stack: contextlib.AsyncExitStack) -> openai.AsyncOpenAI:
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="test", max_retries=0, timeout=120)
    stack.push_async_callback(sdk.close)
    return sdk


@pytest.fixture
async def claude(gw, stack: contextlib.AsyncExitStack) -> anthropic.AsyncAnthropic:
    sdk = anthropic.AsyncAnthropic(base_url=gw.url, api_key="test", max_retries=0, timeout=120)
    stack.push_async_callback(sdk.close)
    return sdk


def _names(fleet: Fleet) -> set[str]:
    return {url.removeprefix("http://") for url in fleet.urls}


async def test_responses_json_stream_retrieve_and_a_chain_on_the_storing_replica(
    client: openai.AsyncOpenAI, fleet: Fleet
) -> None:
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="hello there", max_output_tokens=N, store=True
    )
    first = raw.parse()
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.id.startswith("resp_") and first.usage is not None and first.usage.output_tokens >= 1
    stored_on = raw.headers["x-gateway-endpoint"]
    assert stored_on in _names(fleet)

    got = await client.responses.with_raw_response.retrieve(first.id)
    assert got.headers["x-gateway-endpoint"] == stored_on
    assert got.parse().id == first.id

    stream = await client.responses.create(
        model=MODEL, input="stream to me", max_output_tokens=N, stream=True
    )
    kinds = [event.type async for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds

    previous, on = first.id, stored_on
    seen = {on}
    for step in range(CHAIN):
        raw = await client.responses.with_raw_response.create(
            model=MODEL,
            input=f"step {step}: go on",
            previous_response_id=previous,
            max_output_tokens=N,
            store=True,
        )
        answer = raw.parse()
        assert answer.previous_response_id == previous
        assert raw.headers["x-gateway-endpoint"] == on, f"step {step} left the replica that stored {previous}"
        previous = answer.id
        seen.add(on)
    assert seen == {stored_on}
    # The engine itself has the whole chain: the last response is on the same replica.
    last = await client.responses.with_raw_response.retrieve(previous)
    assert last.headers["x-gateway-endpoint"] == stored_on


async def test_responses_chain_from_a_stream(client: openai.AsyncOpenAI, fleet: Fleet) -> None:
    stream = await client.responses.with_raw_response.create(
        model=MODEL, input="begin", max_output_tokens=N, stream=True, store=True
    )
    on = stream.headers["x-gateway-endpoint"]
    events = [event async for event in stream.parse()]
    response_id = events[0].response.id
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="and then", previous_response_id=response_id, max_output_tokens=N
    )
    assert raw.headers["x-gateway-endpoint"] == on
    assert raw.parse().previous_response_id == response_id


async def test_messages_create_stream_and_count_tokens(claude: anthropic.AsyncAnthropic) -> None:
    message = await claude.messages.create(
        model=MODEL, max_tokens=N, system="be brief", messages=[{"role": "user", "content": "hello there"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content and message.content[0].type == "text"
    assert message.usage.output_tokens >= 1 and message.usage.input_tokens > 3

    kinds = []
    async with claude.messages.stream(
        model=MODEL, max_tokens=N, messages=[{"role": "user", "content": "stream to me"}]
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    assert final.usage.output_tokens >= 1

    counted = await claude.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "one two three four"}]
    )
    assert counted.input_tokens > 3


async def test_messages_error_is_anthropic_shaped(claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        await claude.messages.create(
            model="no-such-model", max_tokens=N, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["type"] == "error"
