"""Every bad input gets its status and an OpenAI error body; the gateway keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.support.harness import Gateway, chat_body, completion_body, debug_endpoints, wait_idle, wait_until

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
USER = [{"role": "user", "content": "hi"}]


async def error_of(resp: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    """Assert the status and the exact OpenAI error shape; return the inner error object."""
    assert resp.status == status, await resp.text()
    assert resp.headers["content-type"].startswith("application/json")
    payload = await resp.json()
    assert list(payload) == ["error"]
    error = payload["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    return error


async def assert_serves(http: aiohttp.ClientSession, gw: Gateway) -> None:
    async with http.post(gw.url + CHAT, json=chat_body()) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"]
    await wait_idle(http, gw)


@pytest.fixture
async def gw_up(start_upstream, start_gateway):
    up = await start_upstream()
    return await start_gateway([up.url]), up


BAD_REQUESTS = [
    pytest.param(CHAT, b'{"model": "tiny", "messages": [', None, id="malformed-json"),
    pytest.param(CHAT, b"\xff\xfe not utf-8", None, id="not-utf8"),
    pytest.param(CHAT, b'["model", "tiny"]', None, id="array-body"),
    pytest.param(COMPLETIONS, b'"just a string"', None, id="string-body"),
    pytest.param(CHAT, {"messages": USER}, "model", id="missing-model"),
    pytest.param(CHAT, {"model": "", "messages": USER}, "model", id="empty-model"),
    pytest.param(CHAT, {"model": 7, "messages": USER}, "model", id="model-not-string"),
    pytest.param(CHAT, {"model": "tiny"}, "messages", id="missing-messages"),
    pytest.param(CHAT, {"model": "tiny", "messages": []}, "messages", id="empty-messages"),
    pytest.param(CHAT, {"model": "tiny", "messages": "hi"}, "messages", id="messages-not-list"),
    pytest.param(CHAT, {"model": "tiny", "messages": ["hi"]}, "messages.0", id="message-not-object"),
    pytest.param(CHAT, {"model": "tiny", "messages": [{"content": "x"}]}, "messages.0.role", id="no-role"),
    pytest.param(
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
        "messages.0.content",
        id="content",
    ),
    pytest.param(CHAT, {"model": "tiny", "messages": USER, "stream": "yes"}, "stream", id="stream-yes"),
    pytest.param(COMPLETIONS, {"model": "tiny"}, "prompt", id="missing-prompt"),
    pytest.param(COMPLETIONS, {"model": "tiny", "prompt": ""}, "prompt", id="empty-prompt"),
    pytest.param(COMPLETIONS, {"model": "tiny", "prompt": []}, "prompt", id="empty-prompt-list"),
    pytest.param(COMPLETIONS, {"model": "tiny", "prompt": {"a": 1}}, "prompt", id="prompt-object"),
    pytest.param(COMPLETIONS, {"model": "tiny", "prompt": "x", "stream": 1}, "stream", id="stream-int"),
    pytest.param(EMBEDDINGS, {"model": "tiny"}, "input", id="missing-input"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
async def test_bad_request_is_400_naming_the_field(path, body, param, gw_up, http):
    gw, up = gw_up
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(gw.url + path, data=data, headers={"content-type": "application/json"}) as resp:
        error = await error_of(resp, 400)
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_request"
    assert error["param"] == param
    if param is not None:
        assert param.split(".")[0] in error["message"]
    assert up.requests == []  # rejected before any upstream saw it
    await assert_serves(http, gw)


async def test_body_over_limit_is_413(start_upstream, start_gateway, http):
    up = await start_upstream()
    gw = await start_gateway([up.url], server={"max_body_bytes": 2048})
    big = chat_body(messages=[{"role": "user", "content": "x" * 8192}])
    async with http.post(gw.url + CHAT, json=big) as resp:
        error = await error_of(resp, 413)
    assert error["code"] == "request_too_large"
    assert error["type"] == "invalid_request_error"
    assert up.requests == []
    await assert_serves(http, gw)


async def test_unknown_model_is_404(gw_up, http):
    gw, _ = gw_up
    async with http.post(gw.url + CHAT, json=chat_body("no-such-model")) as resp:
        error = await error_of(resp, 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert "no-such-model" in error["message"]
    await assert_serves(http, gw)


async def test_all_endpoints_down_is_503_with_retry_after(start_upstream, start_gateway, http):
    up = await start_upstream()
    gw = await start_gateway([up.url], health={"interval_s": 0.05, "unhealthy_threshold": 1})
    up.healthy = False

    async def down() -> bool:
        return not (await debug_endpoints(http, gw))[up.url]["healthy"]

    await wait_until(down, 2.0, "the endpoint to be marked down")
    for body in (chat_body(), chat_body(stream=True)):
        async with http.post(gw.url + CHAT, json=body) as resp:
            error = await error_of(resp, 503)
            assert int(resp.headers["Retry-After"]) >= 1
        assert error["code"] == "no_healthy_endpoint"
        assert error["type"] == "service_unavailable"
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 503
    assert up.requests == []

    up.healthy = True

    async def up_again() -> bool:
        return (await debug_endpoints(http, gw))[up.url]["healthy"]

    await wait_until(up_again, 2.0, "the endpoint to come back")
    await assert_serves(http, gw)


async def test_configured_model_with_nothing_listening_is_503(start_gateway, http):
    from tests.support.harness import free_port

    gw = await start_gateway([{"url": f"http://127.0.0.1:{free_port()}", "models": ["tiny"]}])
    async with http.post(gw.url + COMPLETIONS, json=completion_body()) as resp:
        error = await error_of(resp, 503)
        assert "Retry-After" in resp.headers
    assert error["code"] == "no_healthy_endpoint"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_upstream_first_byte_timeout_is_504(stream, start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([sim.url], timeouts={"first_byte_s": 0.3})
    async with http.post(sim.url + "/admin/fault", json={"mode": "hang"}) as r:
        assert r.status == 200
    async with asyncio.timeout(3):
        async with http.post(gw.url + CHAT, json=chat_body("sim-llama", stream=stream)) as resp:
            error = await error_of(resp, 504)
    assert error["code"] == "upstream_timeout"
    assert error["type"] == "timeout_error"
    await wait_idle(http, gw)
    async with http.post(sim.url + "/admin/fault", json={"mode": "none"}) as r:
        assert r.status == 200
    async with http.post(gw.url + CHAT, json=chat_body("sim-llama", stream=stream)) as resp:
        assert resp.status == 200
        await resp.read()
    await wait_idle(http, gw)


async def test_total_timeout_is_504(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "hold"
    gw = await start_gateway([up.url], timeouts={"total_s": 0.5})
    async with asyncio.timeout(3):
        async with http.post(gw.url + CHAT, json=chat_body()) as resp:
            error = await error_of(resp, 504)
    assert error["type"] == "timeout_error"


async def test_total_timeout_mid_stream_ends_the_stream(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "gated"  # chunk 1, then nothing; idle_s (60 s) never fires, total_s does
    gw = await start_gateway([up.url], timeouts={"total_s": 0.5})
    async with http.post(gw.url + CHAT, json=chat_body(stream=True)) as resp:
        assert resp.status == 200
        raw = await asyncio.wait_for(resp.read(), 3.0)
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert b'"error"' in raw


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/nope", 404, "not_found"),
        ("POST", "/v1/assistants", 404, "not_found"),
        ("GET", "/", 404, "not_found"),
        ("GET", CHAT, 405, "method_not_allowed"),
        ("DELETE", COMPLETIONS, 405, "method_not_allowed"),
        ("POST", "/v1/models", 405, "method_not_allowed"),
    ],
)
async def test_unsupported_path_and_method(method, path, status, code, gw_up, http):
    gw, _ = gw_up
    async with http.request(method, gw.url + path) as resp:
        error = await error_of(resp, status)
        if status == 405:
            assert "POST" in resp.headers["Allow"] or "GET" in resp.headers["Allow"]
    assert error["code"] == code
    await assert_serves(http, gw)


@pytest.mark.parametrize("status", [400, 401, 404, 422, 429])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_upstream_4xx_passes_through_untouched(status, stream, start_upstream, start_gateway, http):
    ups = [await start_upstream(), await start_upstream()]
    body = b'{"error":{"message":"vLLM: max_tokens too large","type":"BadRequestError","code":%d}}' % status
    for up in ups:
        up.mode, up.status, up.body = "status", status, body
    gw = await start_gateway([u.url for u in ups])
    async with http.post(gw.url + CHAT, json=chat_body(stream=stream)) as resp:
        assert resp.status == status
        assert await resp.read() == body
        assert resp.headers["content-type"].startswith("application/json")
        served_by = resp.headers["x-gateway-endpoint"]
    # A client error is the client's: never retried elsewhere.
    assert sum(len(u.requests) for u in ups) == 1
    assert served_by in {u.name for u in ups}
    await wait_idle(http, gw)
    for up in ups:
        up.mode = "ok"
    await assert_serves(http, gw)


async def test_upstream_5xx_from_only_endpoint_passes_through(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode, up.status, up.body = "status", 503, b'{"error":{"message":"engine overloaded"}}'
    gw = await start_gateway([up.url])
    async with http.post(gw.url + CHAT, json=chat_body()) as resp:
        assert resp.status == 503
        assert await resp.read() == up.body
    assert len(up.requests) == 1  # the same endpoint is never retried
    await wait_idle(http, gw)


async def test_upstream_dying_mid_body_is_502(start_upstream, start_gateway, http):
    up = await start_upstream()
    up.mode = "die"
    gw = await start_gateway([up.url])
    async with http.post(gw.url + CHAT, json=chat_body()) as resp:
        error = await error_of(resp, 502)
    assert error["type"] == "upstream_error"
    await wait_idle(http, gw)
    up.mode = "ok"
    await assert_serves(http, gw)


@pytest.mark.parametrize("value", ["urgent", "high", "0"])
async def test_unknown_priority_is_400(value, gw_up, http):
    gw, up = gw_up
    async with http.post(gw.url + CHAT, json=chat_body(), headers={"x-priority": value}) as resp:
        error = await error_of(resp, 400)
    assert error["param"] == "x-priority"
    assert value in error["message"]
    assert up.requests == []
    await assert_serves(http, gw)


@pytest.mark.parametrize("value", ["critical", "standard", "Sheddable", " CRITICAL "])
async def test_known_priorities_are_accepted(value, gw_up, http):
    gw, _ = gw_up
    async with http.post(gw.url + CHAT, json=chat_body(), headers={"x-priority": value}) as resp:
        assert resp.status == 200


async def test_errors_quote_at_most_a_bounded_part_of_the_clients_input(gw_up, http):
    """An error may name the client's value, never all of it: a 15 MB model name came back as a
    45 MB 404 (``é`` escaped to ``\\u00e9``), and a Responses id of 4 MB as a 4 MB one."""
    gw, _ = gw_up
    huge = "é" * 2_000_000
    async with http.post(gw.url + CHAT, json=chat_body(huge)) as resp:
        raw = await resp.read()
        assert resp.status == 404
    error = json.loads(raw)["error"]
    assert (
        len(raw) < 16_384 and error["code"] == "model_not_found" and "2000000 characters" in error["message"]
    )
    body = {"model": "tiny", "input": "hi", "previous_response_id": "r" * 4_000_000}
    async with http.post(gw.url + "/v1/responses", json=body) as resp:
        raw = await resp.read()
        assert resp.status in (400, 404)
    assert len(raw) < 4096
    await assert_serves(http, gw)


async def test_a_long_value_does_not_cut_the_reason_off_the_error(gw_up, http):
    """The value quoted is cut, not the message: a 3,000-character field name holding a number
    out of range, and a 4,000-character priority header, still say what is wrong."""
    gw, _ = gw_up
    raw = json.dumps({**chat_body(), "k" * 3000: "__N__"}).replace('"__N__"', "1e400").encode()
    async with http.post(gw.url + CHAT, data=raw, headers={"content-type": "application/json"}) as resp:
        error = await error_of(resp, 400)
    assert "out of range" in error["message"] and len(error["message"]) < 400
    async with http.post(gw.url + CHAT, json=chat_body(), headers={"x-priority": "p" * 4000}) as resp:
        error = await error_of(resp, 400)
    assert "is not one of" in error["message"] and len(error["message"]) < 400
    await assert_serves(http, gw)
