"""The admission queue: client disconnects, tenant fairness, the global cap, fail-open, off switch."""

from __future__ import annotations

import asyncio

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
from tests.support.harness import debug_endpoints, gateway_metrics, metric_value, wait_until


async def test_client_disconnect_frees_its_queue_slot(spawn, start_upstream, start_gateway, http) -> None:
    up = await start_upstream(metrics_text=DEEP)
    gw = await admission_gateway(start_gateway, [up.url], queue_timeout_s=10, max_queue=1)
    await wait_saturation(http, gw, [up], 1)

    abandoned = spawn(post(http, gw, body("abandoned")))
    await wait_queue(http, gw, 1)
    assert_rate_limited(*await post(http, gw, body("no room")), reason="queue_full")  # the slot is taken
    abandoned.cancel()  # the client goes away: aiohttp closes its connection
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    await wait_queue(http, gw, 0)

    # Its slot is free again: the next request queues (not queue_full) and is served later.
    survivor = spawn(post(http, gw, body("survivor")))
    await wait_queue(http, gw, 1)
    up.metrics_text = IDLE
    status, _, _ = await survivor
    assert status == 200
    assert [r.json["messages"][0]["content"] for r in up.requests] == ["survivor"]
    assert await queue_length(http, gw) == 0


async def test_tenants_share_the_queue_round_robin(spawn, stack, start_upstream, start_gateway, http) -> None:
    """Tenant A floods the queue first; tenant B still gets every other admission."""
    up = await start_upstream()
    gw = await admission_gateway(start_gateway, [up.url], max_concurrency=1, queue_timeout_s=15)
    gated(stack, up)
    holder = spawn(post(http, gw, body("holder", stream=True), tenant="C"))
    await asyncio.wait_for(up.first_chunk_sent.wait(), 3)

    flood = [spawn(post(http, gw, body(f"A{i}"), tenant="A")) for i in range(6)]
    await wait_queue(http, gw, 6)
    modest = [spawn(post(http, gw, body(f"B{i}"), tenant="B")) for i in range(2)]
    await wait_queue(http, gw, 8)

    up.gate.set()
    results = await asyncio.gather(holder, *flood, *modest)
    assert [status for status, _, _ in results] == [200] * 9
    order = [r.json["messages"][0]["content"][0] for r in up.requests][1:]  # the tenant letter
    assert order == ["A", "B", "A", "B", "A", "A", "A", "A"], order  # FIFO would put B last
    assert await queue_length(http, gw) == 0


async def test_global_max_concurrency_caps_in_flight_requests(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    up = await start_upstream()
    gw = await admission_gateway(start_gateway, [up.url], max_concurrency=2, queue_timeout_s=15)
    gated(stack, up)
    streams = [spawn(post(http, gw, body(f"s{i}", stream=True))) for i in range(5)]
    await wait_queue(http, gw, 3)
    await settle()
    assert len(up.requests) == 2, "only max_concurrency requests may reach the upstream"
    assert (await debug_endpoints(http, gw))[up.url]["in_flight"] == 2
    assert_rate_limited(*await post(http, gw, body("shed"), priority="sheddable"), reason="saturated")
    # Critical is bounded by critical_max_concurrency only: it goes past the cap at once.
    assert (await post(http, gw, body("vip"), priority="critical"))[0] == 200
    assert await queue_length(http, gw) == 3

    up.gate.set()
    results = await asyncio.gather(*streams)
    assert [status for status, _, _ in results] == [200] * 5
    assert all(text.rstrip().endswith("data: [DONE]") for _, _, text in results)
    assert len(up.requests) == 5 + 1
    assert await queue_length(http, gw) == 0
    assert (await debug_endpoints(http, gw))[up.url]["in_flight"] == 0


@pytest.mark.parametrize("failure", ["error", "hang"])
async def test_stale_metrics_fail_open(failure: str, start_upstream, start_gateway, http) -> None:
    ups = [await start_upstream(metrics_text=DEEP) for _ in range(2)]
    gw = await start_gateway(
        [u.url for u in ups],
        policy="round-robin",
        health={"interval_s": 0.1, "timeout_s": 0.3},
        scrape={"interval_s": 0.1, "timeout_s": 0.2, "stale_after_s": 0.4},
        admission={"queue_timeout_s": 0.3},
    )
    await wait_saturation(http, gw, ups, 1)
    assert_rate_limited(*await post(http, gw, body(), priority="sheddable"), reason="saturated")

    for up in ups:  # every replica's metrics endpoint breaks; the last scrape said "saturated"
        up.metrics_mode = failure

    async def all_stale() -> bool:
        text = await gateway_metrics(http, gw)
        return all(
            metric_value(text, "llm_gateway_endpoint_metrics_stale", endpoint=u.name) == 1 for u in ups
        )

    await wait_until(all_stale, 3.0, "every replica's metrics to go stale")
    sent = [(p, i) for p in ("sheddable", "standard", "critical") for i in range(3)]
    results = await asyncio.gather(*(post(http, gw, body(f"{p}{i}"), priority=p) for p, i in sent))
    assert [status for status, _, _ in results] == [200] * len(sent), [r[2] for r in results]
    assert not any("x-gateway-degraded" in h for _, h, _ in results)
    assert sum(len(u.requests) for u in ups) == len(sent)
    assert await metric(http, gw, "llm_gateway_admission_queue_wait_seconds_count", priority="standard") == 0


async def test_admission_disabled_never_refuses(start_upstream, start_gateway, http) -> None:
    up = await start_upstream(metrics_text=DEEP)
    gw = await admission_gateway(start_gateway, [up.url], enabled=False, queue_timeout_s=0.2, max_queue=0)
    await wait_saturation(http, gw, [up], 1)  # the detector still sees it; admission ignores it
    sent = [p for p in ("sheddable", "standard", "critical") for _ in range(4)]
    results = await asyncio.gather(*(post(http, gw, body(p), priority=p) for p in sent))
    assert [status for status, _, _ in results] == [200] * len(sent)
    assert len(up.requests) == len(sent)
    assert await metric(http, gw, "llm_gateway_admission_decisions_total", outcome="shed") == 0
    assert await queue_length(http, gw) == 0
