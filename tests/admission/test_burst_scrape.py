"""The burst-triggered scrape against replicas whose /metrics misbehave.

A burst on a replica of unknown capacity makes admission ask for its metrics at once and
hold non-critical requests for the answer. A /metrics that hangs or answers garbage must
cost each request at most ``admission.burst_settle_s``, never a failed request, and the
gateway keeps serving.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.admission.conftest import body, gated, post
from tests.support.harness import gateway_metrics, metric_value, wait_until

SLOW_SCRAPES = {"interval_s": 30.0, "timeout_s": 2.0, "stale_after_s": 60.0}


async def _burst_on_a_gated_replica(spawn, stack, up, gw, http, n: int = 12) -> float:
    """``n`` sheddable streams at once (the class that waits for a burst scrape), held by the replica
    after their first chunk; returns how long until all of them reached it."""
    gated(stack, up)
    started = time.monotonic()
    tasks = [spawn(post(http, gw, body(f"burst {i}", stream=True), priority="sheddable")) for i in range(n)]

    async def all_sent() -> bool:
        return len(up.requests) == n

    await wait_until(all_sent, 5.0, f"all {n} requests to reach the replica")
    sent_within = time.monotonic() - started
    up.gate.set()
    results = await asyncio.gather(*tasks)
    assert [status for status, _, _ in results] == [200] * n
    return sent_within


async def test_a_hanging_metrics_page_delays_a_burst_by_at_most_the_settle_time(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url], policy="round-robin", scrape=SLOW_SCRAPES, health={"interval_s": 30.0})
    up.metrics_mode = "hang"  # after the start-up scrape: every later scrape waits forever
    sent_within = await _burst_on_a_gated_replica(spawn, stack, up, gw, http)
    # One scrape hangs (until its 2 s timeout); the requests behind it wait 0.25 s at most, not 2 s each.
    assert sent_within < 1.5, sent_within
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_burst_scrapes_total", endpoint=up.name) == 1  # one at a time
    status, _, _ = await post(http, gw, body("after"))
    assert status == 200


async def test_a_garbage_metrics_page_fails_the_scrape_not_the_burst(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url], policy="round-robin", scrape=SLOW_SCRAPES, health={"interval_s": 30.0})
    up.metrics_text = "vllm:num_requests_waiting{{{ not prometheus \x00\n" * 50
    await _burst_on_a_gated_replica(spawn, stack, up, gw, http)
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_burst_scrapes_total", endpoint=up.name) >= 1
    assert metric_value(text, "llm_gateway_scrape_errors_total", endpoint=up.name) >= 1
    assert gw.state.registry.get(up.url).learned_capacity == 0  # nothing learned from garbage


async def test_a_failed_burst_scrape_stops_holding_later_requests(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """A burst scrape whose look failed learned nothing: it must not look again, nor a new one
    start before a scrape succeeds. Else, with the page hanging, one is always in progress
    (6 looks of a timeout each, then the next) and every request pays the settle time."""
    up = await start_upstream()
    scrape = {**SLOW_SCRAPES, "timeout_s": 0.5}
    gw = await start_gateway([up.url], policy="round-robin", scrape=scrape, health={"interval_s": 30.0})
    up.metrics_mode = "hang"
    gated(stack, up)
    held = [spawn(post(http, gw, body(f"held {i}", stream=True), priority="standard")) for i in range(8)]

    async def first_look_failed() -> bool:
        text = await gateway_metrics(http, gw)
        return len(up.requests) == len(held) and bool(metric_value(text, "llm_gateway_scrape_errors_total"))

    await wait_until(first_look_failed, 5.0, "the burst scrape's first look to time out")
    started = time.monotonic()
    for i in range(6):
        status, _, _ = await post(http, gw, body(f"later {i}"), priority="sheddable")
        assert status == 200
    took = time.monotonic() - started
    assert took < 0.75, took  # 6 x 0.25 s settle when each waited for a scrape that cannot answer
    up.gate.set()
    assert [status for status, _, _ in await asyncio.gather(*held)] == [200] * len(held)


def _idle_ranks(ranks: int) -> str:
    return "".join(
        f'vllm:num_requests_{name}{{engine="{rank}",model_name="tiny"}} 0.0\n'
        for rank in range(ranks)
        for name in ("running", "waiting")
    )


@pytest.mark.parametrize("ranks", [1, 2])
async def test_a_burst_scrape_looks_again_on_data_parallel_ranks_too(
    spawn, stack, start_upstream, start_gateway, http, ranks: int
) -> None:
    """An engine that does not show what was sent yet is looked at again (up to 6 times) — also
    when the burst went to a data-parallel replica's ranks, whose in-flight counts are the
    targets', not the replica's (which stays 0: one look, then nothing learned)."""
    up = await start_upstream(metrics_text=_idle_ranks(ranks))
    endpoint = {"url": up.url, "data_parallel_size": ranks} if ranks > 1 else up.url
    health = {"interval_s": 30.0}
    gw = await start_gateway([endpoint], policy="round-robin", scrape=SLOW_SCRAPES, health=health)
    assert len(gw.state.registry.targets()) == ranks
    before = up.metrics_asked
    gated(stack, up)
    n = 4 * ranks  # round-robin: 4 per rank, the trigger
    held = [spawn(post(http, gw, body(f"held {i}", stream=True), priority="standard")) for i in range(n)]

    async def looked_six_times() -> bool:
        return up.metrics_asked - before >= 6

    await wait_until(looked_six_times, 10.0, "six looks at an engine that shows nothing of the burst")
    up.gate.set()
    assert [status for status, _, _ in await asyncio.gather(*held)] == [200] * len(held)
