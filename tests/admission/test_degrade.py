"""Graceful degradation of sheddable traffic: clamp ``max_tokens`` under pressure, or serve it
with a configured fallback model when the main pool is saturated."""

from __future__ import annotations

import asyncio

from tests.admission.conftest import (
    DEEP,
    IDLE,
    admission_gateway,
    assert_rate_limited,
    body,
    deep,
    post,
    wait_saturation,
)
from tests.support.upstreams import Upstream, vllm_metrics


def _received(ups: list[Upstream], request_id: str) -> dict:
    """The body the upstream actually got for the gateway request ``request_id`` (exactly once)."""
    seen = [r.json for u in ups for r in u.requests if r.headers.get("x-request-id") == request_id]
    assert len(seen) == 1, f"{request_id} reached the upstreams {len(seen)} times"
    return seen[0]


async def test_sheddable_max_tokens_is_clamped_under_partial_pressure(
    start_upstream, start_gateway, openai_client, http
) -> None:
    ups = [await start_upstream(metrics_text=DEEP), await start_upstream(metrics_text=IDLE)]
    gw = await admission_gateway(start_gateway, [u.url for u in ups], degrade={"sheddable_max_tokens": 8})
    await wait_saturation(http, gw, ups[:1], 1)  # half the pool saturated: pressure 0.5
    await wait_saturation(http, gw, ups[1:], 0)
    client = openai_client(gw)

    raw = await client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "long essay"}],
        max_tokens=500,
        extra_headers={"x-priority": "sheddable"},
    )
    assert raw.parse().choices
    assert raw.headers["x-gateway-degraded"] == "max_tokens=8"
    assert _received(ups, raw.headers["x-request-id"])["max_tokens"] == 8

    raw = await client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "newer field"}],
        max_completion_tokens=300,
        extra_headers={"x-priority": "sheddable"},
    )
    assert raw.headers["x-gateway-degraded"] == "max_completion_tokens=8"
    sent = _received(ups, raw.headers["x-request-id"])
    assert sent["max_completion_tokens"] == 8 and "max_tokens" not in sent

    # No limit given at all: the clamp adds one.
    status, headers, _ = await post(
        http, gw, {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, priority="sheddable"
    )
    assert status == 200 and headers["x-gateway-degraded"] == "max_tokens=8"
    assert _received(ups, headers["x-request-id"])["max_tokens"] == 8

    # Already within the limit: untouched, not marked degraded.
    status, headers, _ = await post(http, gw, body(max_tokens=5), priority="sheddable")
    assert status == 200 and "x-gateway-degraded" not in headers
    assert _received(ups, headers["x-request-id"])["max_tokens"] == 5

    # Standard and critical traffic is never clamped.
    for priority in ("standard", "critical"):
        status, headers, _ = await post(http, gw, body(max_tokens=500), priority=priority)
        assert status == 200 and "x-gateway-degraded" not in headers
        assert _received(ups, headers["x-request-id"])["max_tokens"] == 500


async def test_no_clamp_without_pressure(start_upstream, start_gateway, http) -> None:
    ups = [await start_upstream(metrics_text=IDLE) for _ in range(2)]
    gw = await admission_gateway(start_gateway, [u.url for u in ups], degrade={"sheddable_max_tokens": 8})
    await wait_saturation(http, gw, ups, 0)
    status, headers, _ = await post(http, gw, body(max_tokens=500), priority="sheddable")
    assert status == 200 and "x-gateway-degraded" not in headers
    assert _received(ups, headers["x-request-id"])["max_tokens"] == 500


async def test_sheddable_is_served_by_the_fallback_model_when_its_pool_is_saturated(
    start_upstream, start_gateway, openai_client, http
) -> None:
    big = await start_upstream(models=("big",), metrics_text=deep("big"))
    small = await start_upstream(models=("small",), metrics_text=vllm_metrics(model="small"))
    gw = await admission_gateway(
        start_gateway, [big.url, small.url], queue_timeout_s=0.3, degrade={"fallback_model": "small"}
    )
    await wait_saturation(http, gw, [big], 1)
    client = openai_client(gw)

    raw = await client.chat.completions.with_raw_response.create(
        model="big",
        messages=[{"role": "user", "content": "cheap please"}],
        max_tokens=4,
        extra_headers={"x-priority": "sheddable"},
    )
    completion = raw.parse()
    assert completion.model == "small"
    assert raw.headers["x-gateway-degraded"] == "model=small"
    assert raw.headers["x-gateway-endpoint"] == small.name
    assert big.requests == []
    assert [r.json["model"] for r in small.requests] == ["small"]

    # Standard is not degraded to the fallback: it queues and times out; critical gets "big".
    assert_rate_limited(*await post(http, gw, body(model="big")), reason="queue_timeout")
    status, headers, payload = await post(http, gw, body(model="big"), priority="critical")
    assert status == 200 and payload["model"] == "big" and "x-gateway-degraded" not in headers
    assert len(big.requests) == 1

    # Fallback pool saturated too: sheddable is shed.
    small.metrics_text = deep("small")
    await wait_saturation(http, gw, [small], 1)
    assert_rate_limited(*await post(http, gw, body(model="big"), priority="sheddable"), reason="saturated")
    assert len(small.requests) == 1


async def test_fallback_model_is_not_used_while_the_main_pool_has_room(
    start_upstream, start_gateway, http
) -> None:
    big = await start_upstream(models=("big",), metrics_text=vllm_metrics(model="big"))
    small = await start_upstream(models=("small",), metrics_text=vllm_metrics(model="small"))
    gw = await admission_gateway(start_gateway, [big.url, small.url], degrade={"fallback_model": "small"})
    await wait_saturation(http, gw, [big, small], 0)
    results = await asyncio.gather(
        *(post(http, gw, body(model="big"), priority="sheddable") for _ in range(3))
    )
    assert all(s == 200 and p["model"] == "big" and "x-gateway-degraded" not in h for s, h, p in results)
    assert small.requests == [] and len(big.requests) == 3
