"""The engines' pooling and tokenizer routes through the gateway (real sockets, the simulator),
the clear 404 for unknown /v1 paths, and agent session keys."""

from __future__ import annotations

import pytest

from gateway.request.parse import DEFAULT_OPTIONS, ParseOptions, parse_request
from gateway.request.types import ApiKind

SIM = "sim-llama"


@pytest.fixture
async def gw(start_sim, start_gateway):
    sim = await start_sim()
    return await start_gateway([sim.url])


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/v1/rerank", {"query": "red fox", "documents": ["a red fox", "blue sky"]}, "results"),
        ("/rerank", {"query": "red fox", "documents": ["a red fox", "blue sky"], "top_n": 1}, "results"),
        ("/v2/rerank", {"query": "red fox", "documents": ["a red fox"]}, "results"),
        ("/v1/score", {"text_1": "red fox", "text_2": ["a red fox", "blue sky"]}, "data"),
        ("/score", {"text_1": "red fox", "text_2": "a red fox"}, "data"),
        ("/classify", {"input": ["good", "bad"]}, "data"),
        ("/pooling", {"input": "hello world"}, "data"),
        ("/tokenize", {"prompt": "hello world"}, "tokens"),
        ("/detokenize", {"tokens": [1, 2, 3]}, "prompt"),
    ],
)
async def test_route_reaches_the_engine(gw, http, path, body, key):
    async with http.post(gw.url + path, json={"model": SIM, **body}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-gateway-endpoint"]
        assert key in await resp.json()


async def test_rerank_orders_by_relevance(gw, http):
    body = {"model": SIM, "query": "red fox", "documents": ["blue sky", "the red fox"]}
    async with http.post(gw.url + "/rerank", json=body) as resp:
        results = (await resp.json())["results"]
    assert results[0]["index"] == 1


async def test_tokenize_without_model_uses_the_only_one(gw, http):
    async with http.post(gw.url + "/tokenize", json={"prompt": "a b c"}) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["count"] == 3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"documents": ["x"]}, "query"),
        ("/v1/score", {"text_1": "x"}, "text_2"),
        ("/classify", {"input": 5}, "input"),
        ("/detokenize", {"tokens": "x"}, "tokens"),
        ("/tokenize", {"prompt": {}}, "prompt"),  # was passed on as multimodal "items" (fuzzing)
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/v1/responses", {"input": 5}, "input"),
        ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
async def test_bad_input_is_an_openai_400(gw, http, path, body, param):
    async with http.post(gw.url + path, json={"model": SIM, **body}) as resp:
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


async def test_unknown_model_is_404_on_every_route(gw, http):
    async with http.post(
        gw.url + "/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]}
    ) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"


async def test_unknown_v1_path_names_the_supported_ones(gw, http):
    async with http.post(gw.url + "/v1/assistants", json={}) as resp:
        assert resp.status == 404
        message = (await resp.json())["error"]["message"]
    assert "/v1/responses" in message and "/v1/messages" in message and "/v1/chat/completions" in message


def _session(headers: dict[str, str], body: dict, options: ParseOptions = DEFAULT_OPTIONS) -> str | None:
    import json

    raw = json.dumps({"model": "m", "input": "x", **body}).encode()
    return parse_request(ApiKind.RESPONSES, raw, request_id="r", headers=headers, options=options).session_id


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"x-session-id": "s1"}, {}),
        ({"x-claude-code-session-id": "s1"}, {}),
        ({"session_id": "s1"}, {}),
        ({"session-id": "s1"}, {}),
        ({"x-session-affinity": "s1"}, {}),
        ({}, {"prompt_cache_key": "s1"}),
        ({}, {"user": "s1"}),
    ],
)
def test_agent_clients_session_keys(headers, body):
    assert _session(headers, body) == _session({"x-session-id": "s1"}, {})


def test_session_sources_order_is_configurable():
    options = ParseOptions(session_sources=("body:metadata.user_id", "header:x-session-id"))
    both = _session({"x-session-id": "h"}, {"metadata": {"user_id": "b"}}, options)
    assert (
        both
        == _session({}, {"metadata": {"user_id": "b"}}, options)
        != _session({"x-session-id": "h"}, {}, options)
    )
    assert _session({}, {"prompt_cache_key": "k"}, options) is None  # not a configured source


def test_previous_response_id_defers_to_the_chain():
    assert _session({}, {"previous_response_id": "resp_1"}) is None  # the handler takes the chain's
    assert _session({"x-session-id": "s"}, {"previous_response_id": "resp_1"}) is not None


async def test_a_responses_chain_is_one_session(start_sim, start_gateway, openai_client):
    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([s.url for s in sims], policy="session-aware")
    client = openai_client(gw)
    first = await client.responses.create(model=SIM, input="one", max_output_tokens=2)
    second = await client.responses.create(
        model=SIM, input="two", max_output_tokens=2, previous_response_id=first.id
    )
    store = gw.state.sessions.responses
    assert (await store.get(first.id)).chain == (await store.get(second.id)).chain
    assert gw.state.sessions.store.active() == 1  # the chain's session was pinned
