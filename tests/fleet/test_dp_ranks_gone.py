"""Data-parallel ranks that stop existing take their series and state with them.

Found by review (2026-12-05): a replica that went down lost its learned ranks (it may come back
with another ``--data-parallel-size``) without forgetting them, and a reload from
``data_parallel_size`` 4 to 2 dropped ranks 2 and 3 the same way: their ``endpoint=…#dp2``
gauges (a queue of 5, saturated) were exported for the life of the process.
"""

from __future__ import annotations

import asyncio

from gateway.config.fleet import EndpointConfig
from gateway.http.reload import CONFIG_SOURCE
from tests.support.harness import gateway_metrics, wait_until

FAST = {"health": {"interval_s": 0.05, "timeout_s": 1.0, "unhealthy_threshold": 1},
        "scrape": {"interval_s": 0.05, "timeout_s": 1.0}}  # fmt: skip


def _page(ranks: int, waiting: float) -> str:
    lines = []
    for family, value in (("num_requests_running", 1.0), ("num_requests_waiting", waiting)):
        lines.append(f"# TYPE vllm:{family} gauge")
        lines += [f'vllm:{family}{{engine="{r}",model_name="tiny"}} {value}' for r in range(ranks)]
    return "\n".join(lines) + "\n"


async def _gone_series(http, gw, name: str) -> list[str]:
    text = await gateway_metrics(http, gw)
    return [line for line in text.splitlines() if f"{name}#dp2" in line or f"{name}#dp3" in line]


async def test_a_replica_back_from_down_with_fewer_ranks_exports_none_of_the_old(
    start_upstream, start_gateway, http
) -> None:
    up = await start_upstream(metrics_text=_page(4, 5.0))
    gw = await start_gateway([up.url], **FAST)

    async def ranks(n: int):
        async def check() -> bool:
            return len(gw.state.registry.targets()) == n and all(e.healthy for e in gw.state.registry)

        return check

    await wait_until(await ranks(4), 3.0, "four ranks learned")
    assert await _gone_series(http, gw, up.name)
    up.healthy = False
    await wait_until(lambda: _true(not gw.state.registry.get(up.url).healthy), 3.0, "the replica down")
    up.metrics_text, up.healthy = _page(2, 0.0), True
    await wait_until(await ranks(2), 3.0, "back with two ranks")
    assert await _gone_series(http, gw, up.name) == []


async def test_a_reload_to_fewer_configured_ranks_exports_none_of_the_dropped(
    start_upstream, start_gateway, http
) -> None:
    up = await start_upstream(metrics_text=_page(4, 5.0))
    gw = await start_gateway([{"url": up.url, "data_parallel_size": 4}], **FAST)
    await wait_until(lambda: _true(bool(_scraped(gw))), 3.0, "the ranks scraped")
    assert await _gone_series(http, gw, up.name)
    up.metrics_text = _page(2, 0.0)
    gw.state.membership.apply(CONFIG_SOURCE, [EndpointConfig(url=up.url, data_parallel_size=2)])
    assert len(gw.state.registry.targets()) == 2
    assert await _gone_series(http, gw, up.name) == []


def _scraped(gw) -> bool:
    return all(t.metrics.scraped_at > 0 for t in gw.state.registry.targets())


async def _true(value: bool) -> bool:
    return value


async def test_a_rank_dropped_while_requests_ran_on_it_keeps_no_series_after_they_end(
    stack, start_upstream, start_gateway, http
) -> None:
    """Their outcomes re-created the series the drop had forgotten (found by review, 2026-12-05)."""
    up = await start_upstream(metrics_text=_page(4, 0.0))
    gw = await start_gateway([{"url": up.url, "data_parallel_size": 4}], policy="round-robin", **FAST)
    await wait_until(lambda: _true(_scraped(gw)), 3.0, "the ranks scraped")
    up.mode = "gated"
    stack.callback(up.gate.set)
    body = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    async def stream() -> str:
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.headers["x-gateway-endpoint"]

    streams = [asyncio.create_task(stream()) for _ in range(8)]
    await wait_until(lambda: _true(len(up.requests) == 8), 3.0, "a stream held on every rank")
    up.metrics_text = _page(2, 0.0)
    gw.state.membership.apply(CONFIG_SOURCE, [EndpointConfig(url=up.url, data_parallel_size=2)])
    up.gate.set()
    served = await asyncio.gather(*streams)
    assert f"{up.name}#dp3" in served  # some of them ran on a rank that was dropped meanwhile
    assert await _gone_series(http, gw, up.name) == []


async def test_ranks_a_scrape_no_longer_finds_take_their_prefix_state_too(
    start_upstream, start_gateway, http
) -> None:
    page = _page(4, 0.0) + "".join(
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="1000",engine="{r}"}} 1\n' for r in range(4)
    )
    up = await start_upstream(metrics_text=page)
    gw = await start_gateway([up.url], **FAST)
    prefix = gw.state.prefix

    async def sized() -> bool:
        return f"{up.name}#dp3" in prefix._engine_capacity

    await wait_until(sized, 3.0, "the ranks' KV sizes scraped")
    up.metrics_text = _page(2, 0.0)  # the engine restarted with two ranks, between two scrapes

    async def two() -> bool:
        return len(gw.state.registry.targets()) == 2

    await wait_until(two, 3.0, "two ranks")
    await wait_until(
        lambda: _true(not any("#dp2" in n or "#dp3" in n for n in prefix._engine_capacity)),
        3.0,
        "the dropped ranks' KV sizes forgotten",
    )
    assert await _gone_series(http, gw, up.name) == []
