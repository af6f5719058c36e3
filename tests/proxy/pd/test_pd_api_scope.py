"""Which requests get a prefill leg, and what a prefill replica's refusal means.

Found by review (2026-12-05): every API was disaggregated — a long embeddings, tokenize or
rerank input was computed twice (on a prefill replica, then the decode one), and failed with
502 under ``fallback_to_decode: false``; a Responses prefill leg kept the client's
``max_output_tokens`` (a whole generation on the prefill replica). And a prefill replica's 400
(a prompt past the context window) was re-sent to every other prefill replica, then answered
as a retryable 502 ``prefill_failed``.
"""

from __future__ import annotations

import json

import pytest

from tests.support.harness import chat_body


def _long(tag: str) -> str:  # ~3,000 tokens, never cached: past the default decider's threshold
    return " ".join(f"{tag}{i % 97}" for i in range(3000))


def _fleet(prefills, decode, protocol: str = "vllm") -> list[dict]:
    return [
        *({"url": p.url, "role": "prefill", "engine": protocol, "models": ["tiny"]} for p in prefills),
        {"url": decode.url, "role": "decode", "engine": protocol, "models": ["tiny"]},
    ]


@pytest.mark.parametrize("fallback", [True, False])
async def test_only_generating_apis_get_a_prefill_leg(fallback, start_upstream, start_gateway, http):
    prefill, decode = await start_upstream(), await start_upstream()
    gw = await start_gateway(
        _fleet([prefill], decode),
        pd={"protocol": "vllm", "fallback_to_decode": fallback},
        scrape={"enabled": False},
    )
    calls = {
        "/v1/embeddings": {"model": "tiny", "input": _long("e")},
        "/tokenize": {"model": "tiny", "prompt": _long("t")},
        "/v1/rerank": {"model": "tiny", "query": _long("r"), "documents": ["b"]},
        "/v1/responses": {"model": "tiny", "input": _long("s"), "max_output_tokens": 4000},
    }
    for path, body in calls.items():
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == 200, (path, await resp.text())
        assert decode.requests[-1].path == path
    assert prefill.requests == []  # no leg at all: nothing computed twice, nothing stored there
    # a long chat prompt still is disaggregated (the fake prefill hands over no KV: counted)
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": _long("c")}])
    ) as resp:
        assert resp.status == (200 if fallback else 502)
    assert len(prefill.requests) == 1 and prefill.requests[0].json["max_tokens"] == 1


async def test_a_prefill_replicas_refusal_is_the_clients_answer(start_upstream, start_gateway, http):
    first, second, decode = await start_upstream(), await start_upstream(), await start_upstream()
    message = "This model's maximum context length is 2048 tokens."
    refusal = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    for prefill in (first, second):
        prefill.mode, prefill.status, prefill.body = "status", 400, json.dumps(refusal).encode()
    gw = await start_gateway(
        _fleet([first, second], decode), pd={"protocol": "vllm"}, scrape={"enabled": False}
    )
    body = chat_body(messages=[{"role": "user", "content": _long("c")}])
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400, error
    assert error["message"] == refusal["error"]["message"] and error["code"] == "prefill_refused"
    assert len(first.requests) + len(second.requests) == 1  # not re-sent to the other prefill replica
    assert decode.requests == []  # nor served decode-only, to be refused there again
    async with http.post(
        gw.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": body["messages"]}
    ) as resp:
        answer = await resp.json()
        assert resp.status == 400 and answer["type"] == "error", answer  # in the route's own format
        assert answer["error"]["message"] == refusal["error"]["message"]
