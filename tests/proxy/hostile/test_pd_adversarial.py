"""P/D disaggregation (vLLM NixlConnector style) against misbehaving prefill / decode replicas."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.proxy.hostile.common import STICKY_HEALTH, errors, healthy_after, post, raw
from tests.proxy.hostile.raw import chat_json, endless_json, response, sse_event, until_closed
from tests.proxy.hostile.test_wire_nonsense import good, openai_error
from tests.support.harness import gateway_metrics, metric_value

PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e1",
    "remote_block_ids": [1, 2],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}


def pd_eps(prefills, decodes, engine: str = "vllm") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in prefills:
        ep = {"url": p.url, "role": "prefill", "engine": engine, "models": ["tiny"]}
        if engine == "sglang":
            ep["bootstrap_port"] = 8998
        out.append(ep)
    out += [{"url": d.url, "role": "decode", "engine": engine, "models": ["tiny"]} for d in decodes]
    return out


async def pd_gateway(start_gateway, prefills, decodes, engine="vllm", **kw):
    pd = {"protocol": engine, "decider": "always", **kw.pop("pd", {})}
    kw.setdefault("health", STICKY_HEALTH)
    kw.setdefault("scrape", {"enabled": False})
    kw.setdefault("resilience", {"retry_backoff_s": 0.0})
    return await start_gateway(pd_eps(prefills, decodes, engine), pd=pd, **kw)


async def prefill_ok(i, reader, writer, body):
    writer.write(response(chat_json("x", kv_transfer_params=PARAMS)))
    return True


def prefill_answering(payload: bytes, status: str = "200 OK"):
    async def script(i, reader, writer, body):
        writer.write(response(payload, status))
        return True

    return script


BAD_PREFILL = {
    "no_params": chat_json("x"),
    "params_string": chat_json("x", kv_transfer_params="garbage"),
    "params_list": chat_json("x", kv_transfer_params=[1, 2]),
    "params_without_remote_prefill": chat_json("x", kv_transfer_params={"remote_engine_id": "e"}),
    "error_body_200": b'{"error": {"message": "KV connector not configured", "type": "x"}}',
    "not_json": b"<html>oops</html>",
    "json_null": b"null",
    "not_utf8": b"\xff\xfe\x00garbage",
}


@pytest.mark.parametrize("kind", sorted(BAD_PREFILL))
async def test_bad_prefill_answer_falls_back_to_decode_only(kind, stack, start_gateway, http, caplog):
    p = await raw(stack, prefill_answering(BAD_PREFILL[kind]))
    d = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [p], [d])
    status, body, _ = await post(http, gw)
    assert status == 200, body
    assert p.posts == 1 and d.posts == 1
    assert "kv_transfer_params" not in json.loads(d.bodies[0])
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_prefill_hangs_times_out_and_falls_back(stack, start_gateway, http, caplog):
    closed = asyncio.Event()

    async def hang(i, reader, writer, body):
        if await until_closed(reader, 20):
            closed.set()
        return False

    p = await raw(stack, hang)
    d = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [p], [d], pd={"prefill_timeout_s": 1})
    status, body, _ = await post(http, gw, stream=True)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body
    await asyncio.wait_for(closed.wait(), 3)
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_a_prefill_answer_past_16_mib_is_cut_and_falls_back(stack, start_gateway, http, caplog):
    """A prefill answer is one token and the transfer parameters: one that keeps growing was held
    whole (review 2026-12-05); past 16 MiB the leg fails and the decode replica serves alone."""
    sent_mib: list[int] = []
    p = await raw(stack, endless_json(200, sent_mib))
    d = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [p], [d], pd={"prefill_timeout_s": 20})
    status, body, _ = await post(http, gw)
    assert status == 200, body
    assert len(sent_mib) < 100  # cut off, not read to its end
    assert "kv_transfer_params" not in json.loads(d.bodies[0])
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_pd_prefill_failures_total", kind="too_large") == 1
    await healthy_after(http, gw)


async def test_prefill_hang_is_bounded_by_the_request_deadline(stack, start_gateway, http, caplog):
    """timeouts.total_s is "one hard deadline for the whole request" (forward.py); a hung
    prefill leg must not keep the client waiting past it."""

    async def hang(i, reader, writer, body):
        await until_closed(reader, 30)
        return False

    p = await raw(stack, hang)
    d = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [p], [d], pd={"prefill_timeout_s": 10}, timeouts={"total_s": 2})
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _body, _ = await post(http, gw)
    elapsed = loop.time() - started
    assert elapsed < 4, f"the request took {elapsed:.1f}s with total_s=2 (status {status})"
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_decode_fails_after_prefill_succeeded(stack, start_gateway, http, caplog):
    async def fail(i, reader, writer, body):
        writer.write(
            response(b'{"error": {"message": "decode dead", "type": "x"}}', "503 Service Unavailable")
        )
        return True

    p = await raw(stack, prefill_ok)
    d1 = await raw(stack, fail)
    d2 = await raw(stack, good)
    gw = await pd_gateway(
        start_gateway, [p], [d1, d2], resilience={"retry_backoff_s": 0.0, "consecutive_failures": 100}
    )
    for i in range(4):
        status, body, headers = await post(http, gw, messages=[{"role": "user", "content": f"q{i}"}])
        assert status == 200, body
        assert headers["x-gateway-endpoint"] == d2.name
    for raw_body in d1.bodies + d2.bodies:
        assert json.loads(raw_body)["kv_transfer_params"] == PARAMS
    # a fresh prefill for every decode attempt
    assert d2.posts == 4 and p.posts == 4 + d1.posts, (p.posts, d1.posts, d2.posts)
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_decode_stream_dies_mid_stream(stack, start_gateway, http, caplog):
    async def die(i, reader, writer, body):
        part = sse_event("hi")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(part), part)
        )
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()
        return False

    p = await raw(stack, prefill_ok)
    d = await raw(stack, die)
    gw = await pd_gateway(start_gateway, [p], [d])
    status, body, _ = await post(http, gw, stream=True)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n") and b'"error"' in body, body
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_client_leaves_during_prefill(stack, start_gateway, http, caplog):
    closed = asyncio.Event()
    got = asyncio.Event()

    async def hang(i, reader, writer, body):
        got.set()
        if await until_closed(reader, 20):
            closed.set()
        return False

    p = await raw(stack, hang)
    d = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [p], [d])
    _, port = gw.url.rsplit(":", 1)
    _r, w = await asyncio.open_connection("127.0.0.1", int(port))
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    await w.drain()
    await asyncio.wait_for(got.wait(), 5)
    w.transport.abort()
    await asyncio.wait_for(closed.wait(), 3)
    assert d.posts == 0
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_all_prefill_fail_no_fallback_gives_error(stack, start_gateway, http, caplog):
    p = await raw(stack, prefill_answering(b"{}", "500 Internal Server Error"))
    d = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [p], [d], pd={"fallback_to_decode": False})
    status, body, _ = await post(http, gw)
    assert status == 502, body
    openai_error(body)
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_sglang_prefill_fails_decode_retried(stack, start_gateway, http, caplog):
    p = await raw(stack, prefill_answering(b"{}", "500 Internal Server Error"))

    async def slow_good(i, reader, writer, body):
        await asyncio.sleep(0.2)
        return await good(i, reader, writer, body)

    d = await raw(stack, slow_good)
    gw = await pd_gateway(start_gateway, [p], [d], engine="sglang")
    for stream in (False, True):
        status, body, _ = await post(http, gw, stream=stream)
        assert status == 200, body
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_explicit_policy_never_sends_client_requests_to_prefill_replicas(
    stack, start_gateway, http, caplog
):
    """A prefill replica (vLLM kv_producer) must only ever see prefill legs (max_tokens 1 with
    kv_transfer_params), whatever routing policy is configured."""
    p = await raw(stack, prefill_ok)
    d = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [p], [d], policy="round-robin")
    for _i in range(4):
        status, body, _ = await post(http, gw)
        assert status == 200, body
    for raw_body in p.bodies:
        sent = json.loads(raw_body)
        assert sent.get("max_tokens") == 1 and "kv_transfer_params" in sent, sent
    await healthy_after(http, gw)
