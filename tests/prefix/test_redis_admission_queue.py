"""The admission queue drains to the saturation threshold, not past it, when routing waits on
Redis (``prefix.backend: redis``; a Redis session store under a session policy does the same).

Regression (review, 2026-12-05): the queue grants one waiter per pass so that the next pass
sees its load, but that load is counted on the replica only when the request is sent, after
routing; every pass during a Redis prefix match saw the same load and granted again, so 40
queued requests drained to 19–23 sent (an estimated engine queue of 11–15 against a threshold
of 5), where the in-memory index stopped at 13 (5).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.harness import chat_body, running_gateway
from tests.support.upstreams import vllm_metrics

DEEP = vllm_metrics(waiting=10, running=8)  # saturated: teaches a capacity of 8 running
IDLE = vllm_metrics()
FAST = {"health": {"interval_s": 0.1, "timeout_s": 0.3}, "scrape": {"interval_s": 0.1, "timeout_s": 0.3}}


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_the_queue_drains_to_the_threshold_whatever_routing_waits_on(
    backend, redis_url, key_prefix, start_upstream, stack, http
):
    upstream = await start_upstream(metrics_text=DEEP)
    prefix = (
        {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix} if backend == "redis" else {}
    )
    gateway = running_gateway(
        [upstream.url], admission={"queue_timeout_s": 10, "max_queue": 100}, prefix=prefix, **FAST
    )
    gw = await stack.enter_async_context(gateway)
    await asyncio.sleep(0.5)  # scraped: saturated, its capacity learned
    upstream.mode = "gated"  # what is sent stays in flight

    async def post(index: int) -> int:
        body = chat_body(stream=True, messages=[{"role": "user", "content": f"q{index} " * 300}])
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    tasks = [asyncio.create_task(post(i)) for i in range(40)]
    try:
        await asyncio.sleep(1.0)
        assert not upstream.requests and gw.state.admission.queued() == 40
        upstream.metrics_text = IDLE  # headroom: the queue drains until saturated again
        await asyncio.sleep(1.0)
        endpoint = gw.state.registry.get(upstream.url)
        detector = gw.state.plugin_context.saturation
        threshold = gw.state.config.admission.queue_depth_threshold
        assert detector.estimated_waiting(endpoint) <= threshold, (
            f"{len(upstream.requests)} sent; estimated engine queue {detector.estimated_waiting(endpoint)}"
        )
        assert 0 < len(upstream.requests) < 40 and gw.state.admission.queued() == 40 - len(upstream.requests)
    finally:
        upstream.gate.set()
        statuses = await asyncio.gather(*tasks, return_exceptions=True)
    assert statuses == [200] * 40
    assert gw.state.admission.in_flight == 0 and endpoint.in_flight == 0
