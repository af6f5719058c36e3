"""Priority classes under saturation: critical first, sheddable shed at once, standard queued.

Saturation here comes from tiny upstreams whose ``/metrics`` report a deep waiting
queue (or from the global ``max_concurrency`` cap), so the gateway's decisions are
exact; ``test_saturated_simulator.py`` repeats the essentials against a real engine queue.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.admission.conftest import (
    DEEP,
    IDLE,
    admission_gateway,
    assert_rate_limited,
    body,
    gated,
    metric,
    post,
    queue_length,
    settle,
    wait_queue,
    wait_saturation,
)


async def test_critical_is_admitted_while_standard_requests_wait(
    spawn, start_upstream, start_gateway, openai_client, http
) -> None:
    up = await start_upstream(metrics_text=DEEP)
    gw = await admission_gateway(start_gateway, [up.url], queue_timeout_s=10)
    await wait_saturation(http, gw, [up], 1)

    standards = [spawn(post(http, gw, body(f"std-{i}"))) for i in range(3)]
    await wait_queue(http, gw, 3)

    client = openai_client(gw)
    completion = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "urgent"}],
        max_tokens=4,
        extra_headers={"x-priority": "critical"},
    )
    assert completion.choices[0].message.content
    assert await queue_length(http, gw) == 3, "the standard requests must still be waiting"
    assert [r.json["messages"][0]["content"] for r in up.requests] == ["urgent"]

    up.metrics_text = IDLE  # headroom returns: the queue drains
    results = await asyncio.gather(*standards)
    assert [status for status, _, _ in results] == [200, 200, 200]
    assert await queue_length(http, gw) == 0
    assert len(up.requests) == 4  # one upstream request per response, no duplicates
    assert (
        await metric(
            http,
            gw,
            "llm_gateway_admission_decisions_total",
            priority="standard",
            outcome="admitted",
            reason="dequeued",
        )
        == 3
    )


async def test_a_queued_critical_goes_before_standard_requests_queued_earlier(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """max_concurrency=1 serialises admissions, so the upstream sees the exact admission order."""
    up = await start_upstream()
    gw = await admission_gateway(
        start_gateway, [up.url], max_concurrency=1, critical_max_concurrency=1, queue_timeout_s=10
    )
    gated(stack, up)

    async def stream(content: str, priority: str) -> int:
        async with http.post(
            gw.url + "/v1/chat/completions", json=body(content, stream=True), headers={"x-priority": priority}
        ) as resp:
            await resp.read()
            return resp.status

    holder = spawn(stream("held-critical", "critical"))
    await asyncio.wait_for(up.first_chunk_sent.wait(), 3)
    standards = []
    for i in range(2):  # one at a time: two clients sent together arrive in either order
        standards.append(spawn(post(http, gw, body(f"std-{i}"))))
        await wait_queue(http, gw, i + 1)
    late_critical = spawn(post(http, gw, body("late-critical"), priority="critical"))
    await wait_queue(http, gw, 1, priority="critical")
    await settle()
    assert await queue_length(http, gw) == 2 and await queue_length(http, gw, "critical") == 1

    up.gate.set()
    assert await holder == 200
    statuses = [s for s, _, _ in await asyncio.gather(late_critical, *standards)]
    assert statuses == [200, 200, 200]
    order = [r.json["messages"][0]["content"] for r in up.requests]
    assert order == ["held-critical", "late-critical", "std-0", "std-1"]


async def test_sheddable_is_refused_at_once_with_retry_after(
    start_upstream, start_gateway, openai_client, http
) -> None:
    up = await start_upstream(metrics_text=DEEP)
    gw = await admission_gateway(start_gateway, [up.url], queue_timeout_s=10, retry_after_s=3)
    await wait_saturation(http, gw, [up], 1)
    client = openai_client(gw)

    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "optional"}],
            max_tokens=4,
            extra_headers={"x-priority": "sheddable"},
        )
    assert time.monotonic() - started < 5, "sheddable must not sit in the 10 s queue"
    error = caught.value
    assert error.status_code == 429
    assert error.response.headers["retry-after"] == "3"
    assert error.body["type"] == "rate_limit_exceeded"  # the SDK unwraps {"error": {...}}
    assert error.body["code"] == "rate_limit_exceeded.saturated"
    assert error.response.json()["error"]["type"] == "rate_limit_exceeded"
    assert error.response.headers.get("x-request-id")

    # Raw HTTP too, and nothing reached the upstream.
    assert_rate_limited(*await post(http, gw, body(), priority="sheddable"), reason="saturated")
    assert up.requests == []
    assert await queue_length(http, gw) == 0
    assert (
        await metric(
            http,
            gw,
            "llm_gateway_admission_decisions_total",
            priority="sheddable",
            outcome="shed",
            reason="saturated",
        )
        == 2
    )


async def test_sheddable_waits_for_nobody_even_with_headroom_when_others_queue(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """max_concurrency=1 with a request in flight: standard queues, sheddable is refused."""
    up = await start_upstream()
    gw = await admission_gateway(start_gateway, [up.url], max_concurrency=1, queue_timeout_s=10)
    gated(stack, up)
    holder = spawn(post(http, gw, body("held", stream=True)))
    await asyncio.wait_for(up.first_chunk_sent.wait(), 3)
    queued = spawn(post(http, gw, body("queued")))
    await wait_queue(http, gw, 1)
    assert_rate_limited(*await post(http, gw, body("shed"), priority="sheddable"), reason="saturated")
    up.gate.set()
    assert (await holder)[0] == 200 and (await queued)[0] == 200
    assert [r.json["messages"][0]["content"] for r in up.requests] == ["held", "queued"]


async def test_standard_times_out_of_the_queue_with_429(start_upstream, start_gateway, http) -> None:
    up = await start_upstream(metrics_text=DEEP)
    gw = await admission_gateway(start_gateway, [up.url], queue_timeout_s=0.4)
    await wait_saturation(http, gw, [up], 1)

    started = time.monotonic()
    status, headers, payload = await post(http, gw, body())
    waited = time.monotonic() - started
    assert_rate_limited(status, headers, payload, reason="queue_timeout")
    assert waited >= 0.4, "it must have waited its queue_timeout_s first"
    assert waited < 5  # liveness: it does leave the queue
    assert "0.4s" in payload["error"]["message"]
    assert await queue_length(http, gw) == 0
    assert up.requests == []
    assert (
        await metric(
            http,
            gw,
            "llm_gateway_admission_decisions_total",
            priority="standard",
            outcome="shed",
            reason="queue_timeout",
        )
        == 1
    )
    assert await metric(http, gw, "llm_gateway_admission_queue_wait_seconds_count", priority="standard") == 1


async def test_full_queue_refuses_at_once(spawn, start_upstream, start_gateway, http) -> None:
    up = await start_upstream(metrics_text=DEEP)
    gw = await admission_gateway(start_gateway, [up.url], queue_timeout_s=10, max_queue=2)
    await wait_saturation(http, gw, [up], 1)
    waiting = [spawn(post(http, gw, body(f"q{i}"))) for i in range(2)]
    await wait_queue(http, gw, 2)
    assert_rate_limited(*await post(http, gw, body("third")), reason="queue_full")
    up.metrics_text = IDLE
    assert [s for s, _, _ in await asyncio.gather(*waiting)] == [200, 200]
    assert len(up.requests) == 2


@pytest.mark.parametrize("value", ["urgent", "high", "0", "critical;q=1"])
async def test_unknown_priority_is_a_400(value: str, start_upstream, start_gateway, openai_client) -> None:
    up = await start_upstream()
    gw = await admission_gateway(start_gateway, [up.url])
    client = openai_client(gw)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            extra_headers={"x-priority": value},
        )
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["param"] == "x-priority"
    assert up.requests == []


async def test_priority_header_is_case_and_space_insensitive(start_upstream, start_gateway, http) -> None:
    up = await start_upstream(metrics_text=DEEP)
    gw = await admission_gateway(start_gateway, [up.url], queue_timeout_s=10)
    await wait_saturation(http, gw, [up], 1)
    assert (await post(http, gw, body(), priority=" CRITICAL "))[0] == 200
    assert_rate_limited(*await post(http, gw, body(), priority="Sheddable"), reason="saturated")
