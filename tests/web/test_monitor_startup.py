"""A starting gateway probes and scrapes each replica once, then waits an interval.

It used to make a second round at once (the loops began with a round right after the
synchronous startup one). That second scrape landed among the first requests, recorded
their in-flight count as already seen by the engine and kept the burst-triggered scrape from
firing (the flaky data-parallel burst test in tests/admission: one look instead of six).
"""

from __future__ import annotations

import asyncio

from tests.support.harness import wait_until

SLOW = {"interval_s": 30.0}


async def test_one_scrape_and_one_probe_at_startup_then_the_interval(start_upstream, start_gateway):
    up = await start_upstream()
    gw = await start_gateway([up.url], scrape=SLOW, health=SLOW)
    assert gw.state.registry.get(up.url).healthy
    await asyncio.sleep(0.5)
    assert (up.metrics_asked, up.health_asked) == (1, 1)


async def test_a_replica_down_at_startup_is_probed_again_at_once(start_upstream, start_gateway):
    """The pause is for a startup round that learned everything: a replica that failed its
    first probe is asked again at once, not an interval later."""
    up = await start_upstream()
    up.healthy = False
    gw = await start_gateway([up.url], scrape=SLOW, health=SLOW)
    assert not gw.state.registry.get(up.url).healthy
    await asyncio.sleep(0.5)
    assert up.health_asked == 2


async def test_after_the_pause_the_rounds_go_on(start_upstream, start_gateway):
    up = await start_upstream()
    fast = {"interval_s": 0.2}
    gw = await start_gateway([up.url], scrape=fast, health={**fast, "unhealthy_threshold": 1})
    endpoint = gw.state.registry.get(up.url)
    assert endpoint.healthy
    up.healthy = False
    await wait_until(lambda: asyncio.sleep(0, not endpoint.healthy), 2.0, "the replica marked down")
    scrapes, probes = up.metrics_asked, up.health_asked
    await asyncio.sleep(1.0)
    assert up.metrics_asked >= scrapes + 3 and up.health_asked >= probes + 3
