"""Adversarial tests of the agent-facing APIs (/v1/responses and friends, /v1/messages).

Each test states the behaviour a client relies on; real sockets, real servers, the real SDKs."""

from __future__ import annotations

import asyncio
import hashlib
import json

import anthropic
import pytest

from gateway.http.middleware import IN_FLIGHT
from tests.support.responses_replica import running_replica

MESSAGES_STREAM = {
    "model": "tiny",
    "max_tokens": 10,
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
}
RESPONSES_STREAM = {"model": "tiny", "input": "hi", "stream": True}


# ---- /v1/responses/{id}: the id is a path segment, never a path ---------------------------------


@pytest.mark.parametrize("method", ["GET", "DELETE"])
@pytest.mark.parametrize(
    "encoded_id", ["..%2F..%2Fmetrics", "x%2F..%2F..%2F..%2Fadmin%2Fstate", "..%2F..%2Fv1%2Fmodels"]
)
async def test_response_id_cannot_walk_out_of_the_responses_path(
    method, encoded_id, stack, start_gateway, http
):
    replica = await stack.enter_async_context(running_replica())
    gw = await start_gateway([{"url": replica.url, "api_key": "replica-secret"}])
    request_id = "adversarial-traversal-1"
    async with http.request(
        method, f"{gw.url}/v1/responses/{encoded_id}", headers={"x-request-id": request_id}
    ) as r:
        status = r.status
        await r.read()
    ours = [(m, p, h) for m, p, h in replica.seen if h.get("x-request-id") == request_id]
    outside = [(m, p, h.get("authorization")) for m, p, h in ours if not p.startswith("/v1/responses/")]
    assert outside == [], f"the gateway sent {outside} to the replica (with its api key); answered {status}"
    assert status in (400, 404)


# ---- pass-through answers ------------------------------------------------------------------------


async def test_retrieve_from_a_replica_that_compresses_is_readable(stack, start_gateway, openai_client):
    replica = await stack.enter_async_context(running_replica())
    gw = await start_gateway([replica.url])
    client = openai_client(gw)
    created = await client.responses.create(model="tiny", input="hi")
    replica.compress = True  # e.g. a replica behind a proxy that compresses JSON for clients that accept it
    got = await client.responses.retrieve(created.id)
    assert got.id == created.id


async def test_a_stored_response_past_max_response_bytes_is_a_502_not_held_whole(
    stack, start_gateway, http
) -> None:
    """A replica's answer to GET /v1/responses/{id} was read whole, however large (review 2026-12-05)."""
    replica = await stack.enter_async_context(running_replica())
    gw = await start_gateway([replica.url], limits={"max_response_bytes": 1 << 20})
    async with http.post(gw.url + "/v1/responses", json={"model": "tiny", "input": "hi"}) as r:
        response_id = (await r.json())["id"]
    async with http.get(f"{gw.url}/v1/responses/{response_id}") as r:
        assert r.status == 200
    replica.stored[response_id]["output"] = [{"type": "message", "content": "y" * (2 << 20)}]
    async with http.get(f"{gw.url}/v1/responses/{response_id}") as r:
        assert r.status == 502
        error = (await r.json())["error"]
    assert "larger than 1048576 bytes" in error["message"], error


async def test_pass_through_stream_broken_by_the_replica_ends_cleanly(stack, start_gateway, http):
    replica = await stack.enter_async_context(running_replica())
    gw = await start_gateway([replica.url])
    async with http.post(gw.url + "/v1/responses", json={"model": "tiny", "input": "hi"}) as r:
        response_id = (await r.json())["id"]
    replica.get_mode = "sse-die"
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /v1/responses/{response_id}?stream=true HTTP/1.1\r\nHost: gw\r\n\r\n".encode())
    await writer.drain()
    data = b""
    ended = False
    try:
        while True:
            more = await asyncio.wait_for(reader.read(65536), 3)
            if not more:
                ended = True
                break
            data += more
    except TimeoutError:
        pass
    finally:
        writer.close()
    assert data.count(b"HTTP/1.1 ") == 1, f"a second status line inside the streamed body:\n{data.decode()}"
    assert ended or b"event: error" in data, "the stream neither ended nor carried an error event"


async def test_a_stored_response_replica_that_hangs_is_cut_at_the_proxy_timeouts(stack, start_gateway, http):
    """GET/DELETE/cancel/input_items wait for the replica's answer as a proxied request does, at
    most ``first_byte_s``, and a streamed GET is cut after ``idle_s`` of silence with an error
    that says so; both used to wait for ``total_s`` (15 minutes by default)."""
    replica = await stack.enter_async_context(running_replica())
    timeouts = {"first_byte_s": 0.5, "idle_s": 0.5, "total_s": 60.0}
    gw = await start_gateway([replica.url], timeouts=timeouts)
    async with http.post(gw.url + "/v1/responses", json={"model": "tiny", "input": "hi"}) as r:
        response_id = (await r.json())["id"]
    replica.get_mode = "hang"
    async with asyncio.timeout(20):  # far below total_s: the first-byte limit cut it
        async with http.get(f"{gw.url}/v1/responses/{response_id}") as r:
            assert r.status == 409
            assert (await r.json())["error"]["code"] == "response_replica_unavailable"
    replica.get_mode = "sse-stall"
    async with asyncio.timeout(20):  # the idle limit, not total_s
        async with http.get(f"{gw.url}/v1/responses/{response_id}?stream=true") as r:
            assert r.status == 200
            text = (await r.read()).decode()
    assert text.startswith("event: response.created"), text
    error = json.loads(text.rsplit("event: error\ndata: ", 1)[1])
    assert error["message"].endswith("no data within 0.5 s"), error


# ---- streams: every failure reaches the client as the API's own error ---------------------------


async def test_gateway_cut_of_a_messages_stream_is_an_anthropic_error(start_sim, start_gateway):
    sim = await start_sim(model="m", time_scale=1.0, decode_step_ms=10.0)
    gw = await start_gateway([sim.url])
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0)
    started = asyncio.Event()

    async def consume() -> list[str]:
        kinds = []
        async with claude.messages.stream(
            model="m", max_tokens=2000, messages=[{"role": "user", "content": "story"}]
        ) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "text":
                    started.set()
        return kinds

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    assert gw.app[IN_FLIGHT].cut("the gateway is shutting down") == 1  # what the shutdown timeout does
    with pytest.raises(anthropic.APIStatusError):
        kinds = await asyncio.wait_for(task, 10)
        pytest.fail(f"the stream ended as if complete, without message_stop or an error: {kinds[-3:]}")


@pytest.mark.parametrize(
    "path,body", [("/v1/messages", MESSAGES_STREAM), ("/v1/responses", RESPONSES_STREAM)]
)
@pytest.mark.parametrize("answer", [b"", b": keep-alive\n\n"])
async def test_a_stream_without_any_event_is_an_error(
    path, body, answer, start_upstream, start_gateway, http
):
    upstream = await start_upstream()
    upstream.mode, upstream.status, upstream.body = "status", 200, answer
    upstream.content_type = "text/event-stream"
    gw = await start_gateway([upstream.url])
    async with http.post(gw.url + path, json=body) as r:
        text = (await r.read()).decode()
    assert r.status >= 500 or "event: error" in text, f"{r.status} {text!r}: no event, no error"


@pytest.mark.parametrize(
    "path,body", [("/v1/messages", MESSAGES_STREAM), ("/v1/responses", RESPONSES_STREAM)]
)
async def test_a_complete_non_sse_answer_to_a_stream_is_not_sent_again(
    path, body, start_upstream, start_gateway, http
):
    upstreams = [await start_upstream(), await start_upstream()]
    for upstream in upstreams:  # a whole JSON answer, 200, where a stream was asked for
        upstream.mode, upstream.status = "status", 200
        upstream.body = b'{"id": "msg_1", "type": "message", "role": "assistant", "content": []}'
    gw = await start_gateway([u.url for u in upstreams])
    async with http.post(gw.url + path, json=body) as r:
        status = r.status
        await r.read()
    sent = sum(len(u.requests) for u in upstreams)
    assert sent == 1, f"the request, answered 200 by its replica, was sent {sent} times (client got {status})"


# ---- /v1/messages errors are Anthropic-shaped, whatever stage refuses them ----------------------


async def test_an_oversized_session_header_on_messages_is_an_anthropic_error(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway([sim.url])
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        await claude.messages.create(
            model="sim-llama",
            max_tokens=2,
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-claude-code-session-id": "s" * 1_000_000},
        )
    body = caught.value.body
    assert isinstance(body, dict) and body.get("type") == "error", body


# ---- tenants' token budgets count a Responses request's output bound ----------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 800},
        ),
        ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 800}),  # was charged 256
    ],
)
async def test_the_output_bound_is_charged_up_front(
    path, body, start_upstream, start_gateway, http, tmp_path
):
    upstream = await start_upstream()  # its answers report no usage: what was booked stays
    keys = tmp_path / "keys.yaml"
    digest = hashlib.sha256(b"sk-t").hexdigest()
    keys.write_text(
        "tenants:\n  t: {tokens_per_minute: 1000}\n"
        f"keys:\n  - name: a\n    sha256: {digest}\n    tenant: t\n"
    )
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(keys)})
    async with http.post(gw.url + path, json=body, headers={"authorization": "Bearer sk-t"}) as r:
        assert r.status == 200
        remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    assert remaining < 200, f"{remaining} tokens left: the 800 output tokens were not booked"
