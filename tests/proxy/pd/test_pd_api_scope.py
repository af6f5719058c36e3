"""Which requests get a prefill leg, and what a prefill replica's refusal means.

Found by review (2026-12-05): every API was disaggregated — a long embeddings, tokenize or
rerank input was computed twice (on a prefill replica, then the decode one), and failed with
502 under ``fallback_to_decode: false``; a Responses prefill leg kept the client's
``max_output_tokens`` (a whole generation on the prefill replica). And a prefill replica's 400
(a prompt past the context window) was re-sent to every other prefill replica, then answered
as a retryable 502 ``prefill_failed`` without fallback.
"""

from __future__ import annotations

import asyncio
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


_REFUSAL = {
    "error": {"message": "This model's maximum context length is 2048 tokens.", "type": "BadRequestError"}
}


def _refusing(*prefills, status: int = 400) -> None:
    for prefill in prefills:
        prefill.mode, prefill.status, prefill.body = "status", status, json.dumps(_REFUSAL).encode()


async def test_a_prefill_refusal_is_not_sent_to_another_prefill_replica(start_upstream, start_gateway, http):
    """With fallback (the default) the decode replica gets the client's own body and answers for
    itself: the refusal may be of the leg's one-token cap, not of the request."""
    first, second, decode = await start_upstream(), await start_upstream(), await start_upstream()
    _refusing(first, second)
    gw = await start_gateway(
        _fleet([first, second], decode), pd={"protocol": "vllm"}, scrape={"enabled": False}
    )
    body = chat_body(messages=[{"role": "user", "content": _long("c")}])
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert len(first.requests) + len(second.requests) == 1  # not re-sent to the other one
    assert "kv_transfer_params" not in decode.requests[-1].json  # decode-only: the client's body


async def test_without_fallback_a_prefill_refusal_is_the_clients_answer(start_upstream, start_gateway, http):
    first, second, decode = await start_upstream(), await start_upstream(), await start_upstream()
    _refusing(first, second)
    pd = {"protocol": "vllm", "fallback_to_decode": False}
    gw = await start_gateway(_fleet([first, second], decode), pd=pd, scrape={"enabled": False})
    messages = [{"role": "user", "content": _long("c")}]
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(messages=messages)) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400, error
    assert error["message"] == _REFUSAL["error"]["message"] and error["code"] == "prefill_refused"
    assert len(first.requests) + len(second.requests) == 1 and decode.requests == []
    body = {"model": "tiny", "max_tokens": 4, "messages": messages}
    async with http.post(gw.url + "/v1/messages", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 400 and answer["type"] == "error", answer  # in the route's own format
        assert answer["error"]["message"] == _REFUSAL["error"]["message"]


@pytest.mark.parametrize("status", [401, 403, 500])
async def test_a_prefill_replicas_own_failure_goes_to_the_next_one(
    status, start_upstream, start_gateway, http
):
    """401/403 are the gateway's credentials to that replica (review, 2026-12-05: they were
    answered to the client as its own error): the next prefill replica, then decode-only."""
    first, second, decode = await start_upstream(), await start_upstream(), await start_upstream()
    _refusing(first, second, status=status)
    gw = await start_gateway(
        _fleet([first, second], decode), pd={"protocol": "vllm"}, scrape={"enabled": False}
    )
    body = chat_body(messages=[{"role": "user", "content": _long("c")}])
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert len(first.requests) == len(second.requests) == 1


async def test_sglang_prefill_refusal_falls_back_at_once(start_upstream, start_gateway, http):
    """SGLang's decode leg answers for itself; the refused prefill leg is a failed one (review,
    2026-12-05: raised inside the concurrent prefill task, it was lost and the request hung)."""
    prefill, decode = await start_upstream(), await start_upstream()
    _refusing(prefill)
    fleet = _fleet([prefill], decode, "sglang")
    fleet[0]["bootstrap_port"] = 9
    gw = await start_gateway(
        fleet, pd={"protocol": "sglang"}, scrape={"enabled": False}, timeouts={"total_s": 5}
    )
    body = chat_body(messages=[{"role": "user", "content": _long("c")}])
    async with asyncio.timeout(3), http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_messages_with_extended_thinking(protocol, start_upstream, start_gateway, http):
    """vLLM refuses a one-token leg under a thinking budget (``budget_tokens`` < ``max_tokens``): not
    disaggregated. SGLang's leg is the client's whole request: disaggregated as any other."""
    prefill, decode = await start_upstream(), await start_upstream()
    fleet = _fleet([prefill], decode, protocol)
    fleet[0]["bootstrap_port"] = 9
    gw = await start_gateway(fleet, pd={"protocol": protocol}, scrape={"enabled": False})
    body = {
        "model": "tiny",
        "max_tokens": 4096,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [{"role": "user", "content": _long("m")}],
    }
    async with http.post(gw.url + "/v1/messages", json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert len(prefill.requests) == (1 if protocol == "sglang" else 0)
    assert decode.requests[-1].json["thinking"] == body["thinking"]


class _SGLangDecode:
    """Makes a fake decode replica wait for the KV of a bootstrap room, as SGLang's does."""

    @staticmethod
    def install(decode) -> None:
        plain = decode._inference

        async def inference(request):
            if b"bootstrap_room" in await request.read():
                await asyncio.Event().wait()  # the KV never comes: the prefill was refused
            return await plain(request)

        for route in decode._runner.app.router.routes():
            if route.method == "POST":
                route._handler = inference


@pytest.mark.parametrize("fallback", [True, False])
async def test_an_sglang_refusal_is_not_sent_to_another_prefill_replica(
    fallback, start_upstream, start_gateway, http
):
    first, second, decode = await start_upstream(), await start_upstream(), await start_upstream()
    _refusing(first, second)
    _SGLangDecode.install(decode)
    fleet = _fleet([first, second], decode, "sglang")
    for entry in fleet[:2]:
        entry["bootstrap_port"] = 9
    pd = {"protocol": "sglang", "fallback_to_decode": fallback}
    gw = await start_gateway(fleet, pd=pd, scrape={"enabled": False}, timeouts={"total_s": 8})
    body = chat_body(messages=[{"role": "user", "content": _long("c")}])
    async with asyncio.timeout(5), http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        answer = await resp.json()
        assert resp.status == (200 if fallback else 400), answer
    assert len(first.requests) + len(second.requests) == 1
    if not fallback:
        assert answer["error"]["code"] == "prefill_refused"


async def test_a_refusal_is_remembered_across_decode_attempts(start_upstream, start_gateway, http):
    """A decode attempt fails (503) and another follows: it does not ask a prefill replica again
    what one already refused. (Both decode replicas fail, so requests have two attempts.)"""
    first, second = await start_upstream(), await start_upstream()
    busy, also_busy = await start_upstream(), await start_upstream()
    _refusing(first, second)
    for decode in (busy, also_busy):
        decode.mode, decode.status, decode.body = "status", 503, b'{"error": {"message": "busy"}}'
    fleet = [*_fleet([first, second], busy)[:2], *_fleet([], busy), *_fleet([], also_busy)]
    gw = await start_gateway(fleet, pd={"protocol": "vllm"}, scrape={"enabled": False})
    for i in range(4):  # a new prompt each: never cached, always disaggregated
        body = chat_body(messages=[{"role": "user", "content": _long(f"c{i}x")}])
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 503
    # more decode attempts than requests (the breaker may spare one a second attempt) ...
    assert len(busy.requests) + len(also_busy.requests) > 4
    assert len(first.requests) + len(second.requests) == 4  # ... but one leg a request, not an attempt
