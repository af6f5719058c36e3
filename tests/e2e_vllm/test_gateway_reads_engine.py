"""The gateway's view of real engines: scraped load, KV size, and the usage they report."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.prefix.cache import CHARS_PER_TOKEN
from tests.e2e_vllm.conftest import BLOCK_SIZE, NUM_BLOCKS, Fleet
from tests.e2e_vllm.helpers import MODEL
from tests.support.harness import debug_endpoints, gateway_metrics, metric_value, wait_until

pytestmark = pytest.mark.slow


async def test_debug_endpoints_shows_fresh_engine_load(fleet: Fleet, start_gateway, http) -> None:
    gw = await start_gateway(fleet.urls, policy="prefix-aware")
    rows = await debug_endpoints(http, gw)
    assert sorted(rows) == sorted(fleet.urls)
    for url, row in rows.items():
        assert row["healthy"], url
        assert row["models"] == [MODEL]
        assert row["engine"] == "vllm"
        assert row["waiting"] == 0 and row["running"] == 0
        assert row["kv_usage"] is not None and 0 <= row["kv_usage"] < 1
        assert row["metrics_stale"] is False
        assert row["metrics_age_s"] is not None and row["metrics_age_s"] < 2.0


async def test_prefix_index_capacity_follows_cache_config_info(fleet: Fleet, start_gateway, http) -> None:
    """num_gpu_blocks × block_size from ``vllm:cache_config_info`` bounds the gateway's index."""
    gw = await start_gateway(fleet.urls, policy="prefix-aware")
    block_bytes = gw.state.config.prefix.block_bytes
    expected = int(NUM_BLOCKS * BLOCK_SIZE * CHARS_PER_TOKEN / block_bytes)
    for endpoint in gw.state.registry:
        assert (endpoint.metrics.block_size, endpoint.metrics.num_blocks) == (BLOCK_SIZE, NUM_BLOCKS)
        assert gw.state.prefix.index.capacity(endpoint.name) == expected
    assert expected != gw.state.config.prefix.capacity_blocks  # not the default bound


async def _keep_busy(url: str, stop: asyncio.Event, delay_s: float = 0.0) -> None:
    """Back-to-back long generations on one replica until ``stop`` is set (each lasts ~3 s).

    ``delay_s`` staggers two of these so their restarts never coincide and the replica is never
    briefly idle: a CI run scraped ``running 0`` in such a gap. The load is not what is under
    test: its own session has no total timeout, and a stream the engine cuts is started again
    (a CI run had one cut with "Server disconnected", and the replica then looked idle).
    """
    body = {"model": MODEL, "prompt": "engine load " * 10, "max_tokens": 2000, "ignore_eos": True}
    await asyncio.sleep(delay_s)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as http:
        while not stop.is_set():
            try:
                async with http.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
                    assert resp.status == 200
                    async for _ in resp.content:
                        if stop.is_set():
                            break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)


async def test_gateway_sees_engine_load_and_kv_usage(fleet: Fleet, start_gateway, http) -> None:
    """A busy replica shows running > 0 and KV in use in the gateway's view; an idle one does not.

    The load goes straight to the replica so only the scraper can tell the gateway about it.
    On this shared 2-core machine a decoding engine starves everyone else (its /metrics can
    take ~2 s; on a loaded CI host both replicas' /health went past 2 s and the gateway took
    them out, and 30 s did not see the load), hence a patient scraper and probe, load kept up
    until the gateway has seen it, and what it saw last in the failure.
    """
    scrape = {"interval_s": 0.2, "timeout_s": 8.0}  # a decoding CPU engine's /metrics can be slow
    health = {"interval_s": 1.0, "timeout_s": 10.0}
    gw = await start_gateway(fleet.urls, policy="prefix-aware", scrape=scrape, health=health)
    busy_url, idle_url = fleet.urls
    stop = asyncio.Event()
    load = [asyncio.create_task(_keep_busy(busy_url, stop, delay_s)) for delay_s in (0.0, 1.0)]
    busy_name, idle_name = (url.split("://")[1] for url in fleet.urls)
    last_seen: dict[str, object] = {}  # for the failure message
    try:

        async def seen_busy() -> bool:
            """The debug view and the exported gauges agree the busy replica is busy.

            Both are read in one check: each scrape (every 0.2 s) rewrites them, so reading them
            one after the other could straddle a scrape.
            """
            rows = await debug_endpoints(http, gw)
            text = await gateway_metrics(http, gw)
            running = metric_value(text, "llm_gateway_endpoint_running_requests", endpoint=busy_name)
            kv_usage = metric_value(text, "llm_gateway_endpoint_kv_cache_utilization", endpoint=busy_name)
            last_seen.update(row=rows[busy_url], running_gauge=running, kv_gauge=kv_usage)
            return (
                rows[busy_url]["running"] >= 1
                and rows[busy_url]["kv_usage"] > 0
                and (running or 0) >= 1
                and (kv_usage or 0) > 0
            )

        try:
            await wait_until(seen_busy, 90.0, "the gateway to scrape and export running>=1 and kv_usage>0")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {last_seen}") from None
        rows = await debug_endpoints(http, gw)
        assert rows[idle_url]["running"] == 0 and rows[idle_url]["kv_usage"] == 0
        text = await gateway_metrics(http, gw)
        assert metric_value(text, "llm_gateway_endpoint_running_requests", endpoint=idle_name) == 0
    finally:
        stop.set()
        await asyncio.gather(*load)

    async def drained() -> bool:
        row = (await debug_endpoints(http, gw))[busy_url]
        return row["running"] == 0 and row["kv_usage"] == 0

    await wait_until(drained, 30.0, "the scraped running count and KV usage to return to 0")


async def test_gateway_counts_the_cached_tokens_vllm_reports(fleet: Fleet, start_gateway, http) -> None:
    """Same prompt twice on one replica: vLLM reports whole cached blocks, and the gateway counts them."""
    gw = await start_gateway(fleet.urls, policy="prefix-aware")
    prompt = " ".join(f"usage{i}" for i in range(150))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    usages, served = [], []
    before = metric_value(await gateway_metrics(http, gw), "llm_gateway_observed_cached_tokens_total") or 0.0
    for turn in range(2):
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            usages.append((await resp.json())["usage"])
            served.append(resp.headers["x-gateway-endpoint"])
        if turn == 0:  # the replica's KV events for the prompt arrive after its answer (a CI
            # run on a loaded host sent the second elsewhere before they did): wait for them

            async def stored() -> bool:
                text = await gateway_metrics(http, gw)
                applied = metric_value(text, "llm_gateway_kv_events_applied_total", endpoint=served[0])
                return (applied or 0) > 0

            await wait_until(stored, 10.0, "the serving replica's KV events to reach the gateway")
    assert served[0] == served[1]  # prefix-aware: the second goes where the prefix is
    prompt_tokens = usages[0]["prompt_tokens"]
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    # Full blocks only, and never the last prompt token (it must be computed to sample from).
    assert cached == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0

    async def counted() -> bool:
        text = await gateway_metrics(http, gw)
        return (metric_value(text, "llm_gateway_observed_cached_tokens_total") or 0.0) - before == cached

    await wait_until(counted, 2.0, "llm_gateway_observed_cached_tokens to count the engine's cached tokens")
