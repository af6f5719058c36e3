"""``llm_gateway_endpoint_saturated`` follows the detector when a replica's metrics go stale:
its load is unknown, admission fails open, and the gauge says 0 ("unknown counts as 0").

Regression (review, 2026-12-05): the gauge was written only after a successful scrape, so a
replica whose ``/metrics`` broke while its queue was deep exported 1 for as long as it stayed
broken, and alerts built on it fired on a replica the gateway was sending traffic to.
"""

from __future__ import annotations

from tests.support.harness import chat_body, gateway_metrics, metric_value, wait_until
from tests.support.upstreams import vllm_metrics


async def test_the_saturated_gauge_drops_to_0_when_the_metrics_go_stale(start_upstream, start_gateway, http):
    upstream = await start_upstream(metrics_text=vllm_metrics(waiting=10, running=8))
    gw = await start_gateway(
        [upstream.url],
        scrape={"interval_s": 0.1, "timeout_s": 0.3, "stale_after_s": 0.5},
        health={"interval_s": 0.1, "timeout_s": 0.3},
        admission={"queue_timeout_s": 1},
    )

    async def gauges() -> tuple[float | None, float | None]:
        text = await gateway_metrics(http, gw)
        return (
            metric_value(text, "llm_gateway_endpoint_saturated", endpoint=upstream.name),
            metric_value(text, "llm_gateway_endpoint_metrics_stale", endpoint=upstream.name),
        )

    async def saturated() -> bool:
        return await gauges() == (1.0, 0.0)

    await wait_until(saturated, 5.0, "the deep engine queue to show as saturated")
    upstream.metrics_mode = "error"

    async def stale() -> bool:
        return (await gauges())[1] == 1.0

    await wait_until(stale, 5.0, "the broken /metrics to go stale")
    assert await gauges() == (0.0, 1.0)
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-priority": "sheddable"}
    ) as resp:
        assert resp.status == 200  # fails open: unknown load is no reason to shed

    upstream.metrics_mode = "ok"  # scraped again, the deep queue is saturated again
    await wait_until(saturated, 5.0, "the restored /metrics to show the deep queue again")
