"""Replicas that come and go, restart or serve a huge ``/metrics`` page (found by review, 2026-12-05).

- a replica that left kept its KV size and trust in the prefix cache, and one that left within
  a second of joining kept its exact-index entry and ``endpoint=`` series, for good;
- after a restart or a health flap the prefix index bounded the replica at the default
  capacity for good: the engine's real KV size was re-applied only when it changed;
- a 20 MiB ``/metrics`` page was read whole and parsed on the event loop every scrape.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import chat_body, gateway_metrics, metric_value, wait_until
from tests.support.upstreams import Upstream, vllm_metrics

KV_SIZE = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",engine="0"} 1\n'
FAST = {"health": {"interval_s": 0.05, "timeout_s": 1.0}, "scrape": {"interval_s": 0.05, "timeout_s": 1.0}}


async def test_a_replica_that_left_leaves_no_state_and_no_series(start_upstream, start_gateway, http):
    up = await start_upstream(metrics_text=vllm_metrics() + KV_SIZE)
    async with running_dns() as dns:
        gw = await start_gateway([], discovery=dns.discovery(up.port, interval_s=0.05), **FAST)
        prefix = gw.state.prefix
        for _ in range(3):
            dns.set("llm.test.", "A", "127.0.0.1")

            async def scraped() -> bool:
                e = gw.state.registry.get(up.url)
                return e is not None and e.healthy and up.name in prefix._engine_capacity

            await wait_until(scraped, 3.0, "the replica to join and be scraped")
            async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
                assert resp.status == 200
            dns.set("llm.test.", "A")

            async def gone() -> bool:
                return gw.state.registry.get(up.url) is None

            await wait_until(gone, 3.0, "the replica to leave")
            await asyncio.sleep(0.1)
            assert up.name not in prefix._engine_capacity and up.name not in prefix._trust
            assert prefix.exact is None or not prefix.exact.index.known(up.name)
            text = await gateway_metrics(http, gw)
            assert f'endpoint="{up.name}"' not in text, [
                line for line in text.splitlines() if up.name in line
            ][:5]


async def test_after_a_health_flap_the_index_is_bounded_by_the_engines_kv_size_again(
    start_upstream, start_gateway, http
):
    up = await start_upstream(metrics_text=vllm_metrics() + KV_SIZE)
    gw = await start_gateway([up.url], **FAST)

    async def capacity() -> float | None:
        text = await gateway_metrics(http, gw)
        return metric_value(text, "llm_gateway_prefix_index_capacity_blocks", endpoint=up.name)

    async def engine_sized() -> bool:
        return (await capacity()) not in (None, float(gw.state.config.prefix.capacity_blocks))

    await wait_until(engine_sized, 3.0, "the engine's KV size to bound the index")
    sized = await capacity()
    endpoint = gw.state.registry.get(up.url)
    up.healthy = False
    await wait_until(lambda: _is(not endpoint.healthy), 3.0, "the replica to be down")
    up.healthy = True
    await wait_until(lambda: _is(endpoint.healthy), 3.0, "the replica to be back")
    await asyncio.sleep(0.3)  # several scrapes of the same KV size
    assert await capacity() == sized


async def _is(value: bool) -> bool:
    return value


async def test_a_huge_metrics_page_is_a_failed_scrape_and_requests_go_on(start_upstream, start_gateway, http):
    up = await start_upstream()
    gw = await start_gateway([up.url], **FAST)
    endpoint = gw.state.registry.get(up.url)
    await wait_until(lambda: _is(endpoint.metrics.scraped_at > 0), 3.0, "a first scrape")
    up.metrics_text = vllm_metrics() + "# filler\n" * (20 * 1024 * 1024 // 9)  # 20 MiB

    async def failing() -> bool:
        text = await gateway_metrics(http, gw)
        return (metric_value(text, "llm_gateway_scrape_errors_total", endpoint=up.name) or 0) >= 2

    await wait_until(failing, 5.0, "the oversize page to count as failed scrapes")
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 200


class _OddCharset(Upstream):
    """Serves its page as ``text/plain; charset=bogus`` (a codec Python does not know)."""

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_asked += 1
        if self.metrics_mode == "error":
            return web.Response(status=500, text="broken")
        odd = {"content-type": "text/plain; charset=bogus"}
        return web.Response(body=self.metrics_text.encode(), headers=odd)


async def test_an_unknown_charset_neither_stops_start_up_nor_the_others_scrapes(stack, start_gateway, http):
    odd = _OddCharset()
    await odd.start()
    stack.push_async_callback(odd.stop)
    other = _OddCharset()
    other.metrics_text = vllm_metrics(waiting=3.0)
    await other.start()
    stack.push_async_callback(other.stop)
    gw = await start_gateway([odd.url, other.url], **FAST)  # started: the page was read as UTF-8
    odd_ep, other_ep = gw.state.registry.get(odd.url), gw.state.registry.get(other.url)
    await wait_until(lambda: _is(other_ep.metrics.waiting == 3.0), 3.0, "the page read despite its charset")
    other.metrics_mode = "error"  # the other replica's scrapes fail: it must go stale
    await wait_until(lambda: _is(other_ep.metrics.stale), 5.0, "the failing replica to go stale")
    assert not odd_ep.metrics.stale


async def test_a_large_metrics_page_is_parsed_once_per_scrape_and_off_the_loop(
    start_upstream, start_gateway, http, monkeypatch
):
    """A page past 256 KiB (under the 16 MiB cap) is parsed in a worker thread — and only there:
    the data-parallel rank pass parsed the whole page a second time, on the event loop (a 2.5 MB
    page held the loop ~1 s every scrape). The prometheus parser is wrapped, not replaced, to
    see on which thread each page is parsed."""
    import threading

    import gateway.fleet.scraper as scraper

    parses: list[tuple[int, bool]] = []  # (text length, on the event loop's thread)
    real = scraper.text_string_to_metric_families
    loop_thread = threading.get_ident()

    def watched(text: str):
        parses.append((len(text), threading.get_ident() == loop_thread))
        return real(text)

    monkeypatch.setattr(scraper, "text_string_to_metric_families", watched)
    up = await start_upstream()
    line = 'vllm:num_requests_running{model_name="tiny",engine="0"} 1\n'
    up.metrics_text = vllm_metrics() + line * (1_500_000 // len(line))
    gw = await start_gateway([up.url], **FAST)
    endpoint = gw.state.registry.get(up.url)
    await wait_until(
        lambda: _is(up.metrics_asked >= 4 and (endpoint.metrics.running or 0) > 20_000), 5.0, "scrapes"
    )
    big = [on_loop for length, on_loop in parses if length > 1_000_000]
    assert big and not any(big), parses[-6:]  # every big page off the loop
    assert len(big) <= up.metrics_asked  # once per scrape, not once more for the ranks
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 200
