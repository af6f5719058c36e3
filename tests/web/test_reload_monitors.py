"""A reload changes the health checks and the scrapes of a running gateway, at once.

Before, ``health`` and ``scrape`` were neither applied nor listed as restart-only: a reload
from a 30 s interval to a short one was silently ignored until a restart. Now the new
intervals end the pause in progress, timeouts and thresholds apply from the next round, and
``scrape.enabled`` (whether the poller runs at all) is kept with a warning.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.http.reload import apply_config
from tests.support.harness import wait_until

SLOW = {"interval_s": 30.0}


async def test_a_shorter_scrape_interval_takes_effect_without_a_restart(start_upstream, start_gateway):
    up = await start_upstream()
    gw = await start_gateway([up.url], scrape=SLOW, health=SLOW)
    await wait_until(lambda: asyncio.sleep(0, up.metrics_asked >= 1), 3.0, "the startup scrape")
    await asyncio.sleep(0.3)
    before = up.metrics_asked
    config = gw.state.config
    await apply_config(
        gw.state, config.model_copy(update={"scrape": config.scrape.model_copy(update={"interval_s": 0.05})})
    )
    await wait_until(lambda: asyncio.sleep(0, up.metrics_asked >= before + 5), 3.0, "scrapes every 50 ms")
    assert gw.state.config.scrape.interval_s == 0.05


async def test_a_shorter_health_interval_and_threshold_take_effect_without_a_restart(
    start_upstream, start_gateway
):
    up = await start_upstream()
    gw = await start_gateway([up.url], scrape=SLOW, health=SLOW)
    endpoint = gw.state.registry.get(up.url)
    await wait_until(lambda: asyncio.sleep(0, endpoint.healthy), 3.0, "the first probe")
    config = gw.state.config
    health = config.health.model_copy(update={"interval_s": 0.05, "unhealthy_threshold": 1})
    await apply_config(gw.state, config.model_copy(update={"health": health}))
    up.healthy = False  # one failed probe, 50 ms away, is enough now
    await wait_until(lambda: asyncio.sleep(0, not endpoint.healthy), 2.0, "the replica marked down")
    up.healthy = True
    await wait_until(lambda: asyncio.sleep(0, endpoint.healthy), 2.0, "the replica back up")


async def test_turning_scraping_off_needs_a_restart_and_says_so(start_upstream, start_gateway, caplog):
    up = await start_upstream()
    gw = await start_gateway([up.url], scrape=SLOW, health=SLOW)
    config = gw.state.config
    scrape = config.scrape.model_copy(update={"enabled": False, "stale_after_s": 90.0})
    with caplog.at_level(logging.WARNING, logger="gateway.http.reload"):
        await apply_config(gw.state, config.model_copy(update={"scrape": scrape}))
    assert "scrape.enabled changed; it takes effect after a restart" in caplog.text
    assert gw.state.config.scrape.enabled is True  # the running value stays
    assert gw.state.config.scrape.stale_after_s == 90.0  # the rest of the section applies
