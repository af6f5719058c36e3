"""Anthropic Messages through the gateway with the official ``anthropic`` SDK, against the
simulator; errors on these routes in Anthropic's format."""

from __future__ import annotations

import anthropic
import pytest

from tests.support.harness import wait_until

SIM = "sim-llama"


@pytest.fixture
async def gw(start_sim, start_gateway):
    sims = [await start_sim(), await start_sim()]
    return await start_gateway([s.url for s in sims])


@pytest.fixture
def claude(stack):
    def make(gateway, **kw) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(
            base_url=gateway.url, api_key=kw.pop("api_key", "test"), max_retries=0, timeout=10, **kw
        )
        stack.push_async_callback(client.close)
        return client

    return make


async def test_messages_create(gw, claude):
    client = claude(gw)
    message = await client.messages.create(
        model=SIM, max_tokens=5, system="You are terse.", messages=[{"role": "user", "content": "Say hello"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 5
    assert message.stop_reason == "max_tokens"


async def test_messages_stream_events_pass_through(gw, claude):
    client = claude(gw)
    kinds = []
    async with client.messages.stream(
        model=SIM, max_tokens=6, messages=[{"role": "user", "content": "Tell me a story"}]
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text and final.usage.output_tokens == 6


async def test_count_tokens(gw, claude):
    client = claude(gw)
    counted = await client.messages.count_tokens(
        model=SIM, messages=[{"role": "user", "content": "one two three"}]
    )
    assert counted.input_tokens > 3


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": SIM, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
        ({"model": SIM, "max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
        (
            {"model": SIM, "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
            404,
            "not_found_error",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ],
)
async def test_bad_input_gets_anthropic_errors(gw, http, body, status, kind):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and "max_tokens" not in body:
            continue  # count_tokens needs no max_tokens
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == status, await resp.text()
            payload = await resp.json()
        assert payload["type"] == "error"
        assert payload["error"]["type"] == kind and payload["error"]["message"]


async def test_sdk_raises_typed_errors(gw, claude):
    client = claude(gw)
    with pytest.raises(anthropic.NotFoundError) as caught:
        await client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "not_found_error"


async def test_invalid_json_is_an_anthropic_400(gw, http):
    async with http.post(
        gw.url + "/v1/messages", data=b"{nope", headers={"content-type": "application/json"}
    ) as r:
        assert r.status == 400
        assert (await r.json())["type"] == "error"


async def test_x_api_key_authenticates(start_sim, start_gateway, claude, tmp_path):
    import hashlib

    sim = await start_sim()
    keys = tmp_path / "keys.yaml"
    digest = hashlib.sha256(b"sk-ant-good").hexdigest()
    keys.write_text(f"tenants:\n  t: {{}}\nkeys:\n  - name: a\n    sha256: {digest}\n    tenant: t\n")
    gw = await start_gateway([sim.url], auth={"enabled": True, "keys_file": str(keys)})
    good = claude(gw, api_key="sk-ant-good")
    message = await good.messages.create(model=SIM, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert message.content
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await claude(gw, api_key="sk-ant-bad").messages.create(
            model=SIM, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.body["error"]["type"] == "authentication_error"


async def test_client_disconnect_mid_stream_aborts_upstream(start_sim, start_gateway, http):
    sim = await start_sim(time_scale=1.0)
    gw = await start_gateway([sim.url])
    body = {"model": SIM, "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    resp = await http.post(gw.url + "/v1/messages", json=body)
    assert resp.status == 200
    await resp.content.readuntil(b"content_block_delta")
    assert sim.engine.state()["running"] == 1
    resp.close()

    async def aborted() -> bool:
        state = sim.engine.state()
        return state["running"] == 0 and state["waiting"] == 0

    await wait_until(aborted, 3.0, "the simulator to abort the request")
