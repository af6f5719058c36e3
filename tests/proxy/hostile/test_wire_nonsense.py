"""Upstreams that answer nonsense on the wire; the client must get a well-formed answer."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.proxy.hostile.common import errors, gateway, healthy_after, post, raw
from tests.proxy.hostile.raw import chat_json, response, sse_event


async def good(i, reader, writer, body):
    if json.loads(body).get("stream"):
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for part in (sse_event("hi"), sse_event(" there"), b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        writer.write(b"0\r\n\r\n")
        return True
    writer.write(response(chat_json("good")))
    return True


def openai_error(body: bytes) -> dict:
    payload = json.loads(body)
    assert set(payload) == {"error"}, payload
    assert payload["error"]["message"], payload
    return payload["error"]


BAD = {
    "invalid_status_line": b"HTTP/1.1 OK-ish nonsense\r\n\r\n",
    "not_http": b"SSH-2.0-OpenSSH_9.0\r\n",
    "bad_chunk_size": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"ZZ\r\nabc\r\n"
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD))
async def test_garbage_before_first_byte_is_retried(kind, stack, start_gateway, http, caplog):
    async def bad(i, reader, writer, body):
        writer.write(BAD[kind])
        await writer.drain()
        await asyncio.sleep(0.05)
        return False

    b = await raw(stack, bad)
    g = await raw(stack, good)
    gw = await gateway(start_gateway, b.url, g.url)
    for _ in range(4):
        status, body, headers = await post(http, gw)
        if kind == "bad_chunk_size":
            # the headers were fine: a broken body of a buffered answer is an upstream error
            assert status in (200, 502), body
            if status == 502:
                openai_error(body)
        else:
            assert status == 200, body
            assert headers["x-gateway-endpoint"] == g.name
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_all_upstreams_garbage_gives_openai_error(stack, start_gateway, http, caplog):
    async def bad(i, reader, writer, body):
        writer.write(b"HTTP/1.1 OK-ish nonsense\r\n\r\n")
        return False

    a = await raw(stack, bad)
    b = await raw(stack, bad)
    gw = await gateway(start_gateway, a.url, b.url)
    for stream in (False, True):
        status, body, _ = await post(http, gw, stream=stream)
        assert status in (502, 503), body
        openai_error(body)
    await healthy_after(http, gw)
    assert not errors(caplog)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_interim_1xx_response_is_skipped(stream, stack, start_gateway, http, caplog):
    """An interim 1xx (103 Early Hints, 100 Continue) precedes the final response (RFC 9110 §15.2)."""

    async def hints(i, reader, writer, body):
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        return await good(i, reader, writer, body)

    u = await raw(stack, hints)
    gw = await gateway(start_gateway, u.url)
    status, body, _headers = await post(http, gw, stream=stream)
    assert status == 200, (status, body)
    if stream:
        assert body.endswith(b"data: [DONE]\n\n") and b"there" in body, body
    else:
        assert json.loads(body)["choices"][0]["message"]["content"] == "good"
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_content_length_larger_than_body_then_close(stack, start_gateway, http, caplog):
    async def short(i, reader, writer, body):
        payload = chat_json()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (len(payload) + 100)
            + payload
        )
        await writer.drain()
        return False

    u = await raw(stack, short)
    gw = await gateway(start_gateway, u.url)
    status, body, _ = await post(http, gw)
    assert status == 502, body
    openai_error(body)
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_chunked_stream_then_close_without_last_chunk(stack, start_gateway, http, caplog):
    async def cut(i, reader, writer, body):
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        part = sse_event("hi")
        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        writer.write(b'40\r\ndata: {"half')  # close mid-chunk
        await writer.drain()
        await asyncio.sleep(0.05)
        return False

    u = await raw(stack, cut)
    gw = await gateway(start_gateway, u.url)
    status, body, _ = await post(http, gw, stream=True)
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n"), body
    assert b'"error"' in body and b"half" not in body, body
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_unsolicited_response_on_idle_connection_is_not_served(stack, start_gateway, http, caplog):
    """A pooled keep-alive connection that receives bytes while idle is unusable: a later request
    must never get them as its answer."""

    async def extra(i, reader, writer, body):
        writer.write(response(chat_json(f"answer-{i}")))
        await writer.drain()
        await asyncio.sleep(0.05)
        # a second, unsolicited response on the now idle connection, headers and part of a body
        poison = chat_json("POISON")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(poison)
            + poison[:20]
        )
        await writer.drain()
        return True

    u = await raw(stack, extra)
    gw = await gateway(start_gateway, u.url)
    for _i in range(3):
        status, body, _ = await post(http, gw)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"].startswith("answer-"), body
        await asyncio.sleep(0.15)
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_content_length_smaller_than_body_does_not_leak_into_body(stack, start_gateway, http, caplog):
    """Bytes after a response's Content-Length (here: a whole second response) are not its body."""

    async def doubled(i, reader, writer, body):
        first = response(chat_json(f"answer-{i}"))
        second = response(b'{"smuggled": true}')
        writer.write(first + second)  # one write
        await writer.drain()
        return True

    u = await raw(stack, doubled)
    gw = await gateway(start_gateway, u.url)
    for _ in range(3):
        status, body, _ = await post(http, gw)
        assert status == 200, body
        assert b"smuggled" not in body, body
        assert json.loads(body)["choices"][0]["message"]["content"].startswith("answer-")
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_5xx_with_huge_body_is_retried_promptly(stack, start_gateway, http, caplog):
    big = b"x" * (32 * 1024 * 1024)

    async def huge(i, reader, writer, body):
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n"
            % len(big)
        )
        writer.write(big)
        await writer.drain()
        return True

    b = await raw(stack, huge)
    g = await raw(stack, good)
    gw = await gateway(start_gateway, b.url, g.url)
    for _ in range(2):
        status, body, _headers = await post(http, gw)
        assert status == 200, body[:200]
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_5xx_with_trickling_body_does_not_delay_the_retry(stack, start_gateway, http, caplog):
    """A 503 whose body trickles must not hold the retry for the whole first_byte_s."""

    async def trickle(i, reader, writer, body):
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"
        )
        for _ in range(100):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.1)
        return False

    b = await raw(stack, trickle)
    g = await raw(stack, good)
    gw = await gateway(start_gateway, b.url, g.url, timeouts={"first_byte_s": 8})
    started = time.monotonic()
    status, body, headers = await post(http, gw)
    if headers.get("x-gateway-endpoint") == g.name:
        status, body, headers = await post(http, gw)
    elapsed = time.monotonic() - started
    assert status == 200, body[:200]
    assert elapsed < 4, f"retry after a 503 took {elapsed:.1f}s"
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_huge_response_headers(stack, start_gateway, http, caplog):
    async def big_headers(i, reader, writer, body):
        payload = chat_json()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Junk: "
            + b"a" * (1024 * 1024)
            + b"\r\nContent-Length: %d\r\n\r\n" % len(payload)
            + payload
        )
        await writer.drain()
        return True

    b = await raw(stack, big_headers)
    gw = await gateway(start_gateway, b.url)
    status, body, _headers = await post(http, gw)
    assert status in (200, 502), body[:200]
    await healthy_after(http, gw)
    assert not errors(caplog)


async def test_malformed_answer_on_reused_connection_is_not_resent_to_same_replica(
    stack, start_gateway, http, caplog
):
    """The replica read the request and answered (garbage): it is not a stale idle connection.
    Re-sending it to the same replica duplicates the work and skips the retry budget and the
    "never the same endpoint" rule."""

    async def second_is_garbage(i, reader, writer, body):
        if i == 1:
            writer.write(b"HTTP/1.1 OK-ish nonsense\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            return False
        writer.write(response(chat_json(f"answer-{i}")))
        return True

    u = await raw(stack, second_is_garbage)
    gw = await gateway(start_gateway, u.url, limits={"retries": 0})
    status, body, _ = await post(http, gw)
    assert status == 200
    status, body, _ = await post(http, gw)  # goes out on the pooled connection of the first
    assert status == 502, (status, body)
    openai_error(body)
    assert u.posts == 2, f"the replica received {u.posts} POSTs for 2 client requests (retries: 0)"
    await healthy_after(http, gw)
    assert not errors(caplog)


HUGE = b"1" + b"0" * 400  # past a double: float() of it raises OverflowError


async def huge_usage(i, reader, writer, body):
    usage = b'"usage":{"prompt_tokens":%s,"completion_tokens":1,"total_tokens":%s}' % (HUGE, HUGE)
    if json.loads(body).get("stream"):
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        last = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],' + usage + b"}\n\n"
        for part in (sse_event("hi"), sse_event(" there"), last, b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.01)  # own segments: the relay, not the one-read path
        writer.write(b"0\r\n\r\n")
        return True
    payload = chat_json("good")[:-1] + b"," + usage + b"}"
    writer.write(response(payload))
    return True


@pytest.mark.parametrize("policy", ["prefix-aware", "round-robin"])
async def test_an_absurd_usage_count_leaves_the_answer_whole(policy, stack, start_gateway, http, caplog):
    """A usage count past a double (401 digits) is not a count: it is ignored. It used to reach
    float arithmetic in the prefix hook and turn the replica's 200 into a 500, or leave a
    stream without its chunked terminator."""
    u = await raw(stack, huge_usage)
    gw = await gateway(start_gateway, u.url, policy=policy)
    status, body, _ = await post(http, gw)
    assert status == 200, body
    assert json.loads(body)["usage"]["prompt_tokens"] == int(HUGE)  # passed on as it came
    status, body, _ = await post(http, gw, stream=True)  # a missing terminator raises in read()
    assert status == 200, body
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    await healthy_after(http, gw)
    assert not errors(caplog)
