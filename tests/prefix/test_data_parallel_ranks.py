"""Data-parallel ranks as routing targets (gateway/fleet/dp.py), on simulators with
``data_parallel_size`` (N schedulers and KV caches behind one port, as vLLM's) and an
in-process gateway, all on real sockets.

The engine counts the cached tokens, so "the gateway sent it to the rank that holds the
prefix" is proved by ``usage.prompt_tokens_details.cached_tokens``, and which rank served
it by the simulator's own per-rank counters.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from gateway.http.state import STATE
from loadtest.simulator import RunningSimulator, SimConfig
from loadtest.simulator.server import start_runner
from tests.prefix.conftest import GatewayProcessless, gateway_config
from tests.support.harness import metric_value

MODEL = "sim-llama"
EXACT = {"exact": "auto", "kv_events": {"rediscover_s": 0.3, "replay_timeout_s": 1.0}}


def host(sim: RunningSimulator) -> str:
    return sim.url.split("://", 1)[1]


def registry(gw: GatewayProcessless) -> Any:
    assert gw.gateway is not None
    return gw.gateway.app[STATE].registry


async def ask(
    http: aiohttp.ClientSession, gw: GatewayProcessless, text: str, max_tokens: int = 4
) -> tuple[str, int, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        endpoint = r.headers["x-gateway-endpoint"]
        predicted = int(r.headers["x-gateway-predicted-cached-tokens"])
    return endpoint, predicted, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def wait_ranks(gw: GatewayProcessless, sim: RunningSimulator, n: int, *, live: bool = True) -> None:
    """Until the gateway routes to ``n`` rank targets of ``sim`` (0: the URL alone), events live."""
    exact = gw.gateway.app[STATE].prefix.exact  # type: ignore[union-attr]
    want = [f"{host(sim)}#dp{r}" for r in range(n)] if n > 1 else [host(sim)]
    async with asyncio.timeout(10):
        while True:
            names = [t.name for t in registry(gw).targets() if t.url == sim.url and t.healthy]
            if names == want and (not live or all(exact.index.live(name) for name in want)):
                return
            await asyncio.sleep(0.05)


def document(i: int) -> str:
    return f"document {i}: " + " ".join(f"fact{i}x{j}" for j in range(60))


async def test_a_repeated_prefix_goes_to_the_rank_that_holds_it(start_sims, start_gateway, http) -> None:
    (sim,) = await start_sims(1, data_parallel_size=2, kv_events=True, kv_blocks=512)
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_ranks(gw, sim, 2)
    dp = sim.state.dp
    assert dp is not None
    # The first round at once: in-flight load spreads the documents over both ranks (one
    # after another, ties and a scrape landing mid-request decide, and may pick one rank).
    answers = await asyncio.gather(*(ask(http, gw, document(i) + " question one") for i in range(8)))
    first = {i: endpoint for i, (endpoint, _, _) in enumerate(answers)}
    assert all(cached == 0 for _, _, cached in answers)
    assert set(first.values()) == {f"{host(sim)}#dp0", f"{host(sim)}#dp1"}  # both ranks used
    assert sum(dp.picked) == 8 and min(dp.picked) >= 2  # the simulator agrees: the header was honoured
    await asyncio.sleep(0.3)  # the events of the first round applied
    for i in range(8):
        endpoint, predicted, cached = await ask(http, gw, document(i) + " question two")
        assert endpoint == first[i]  # the rank holding the document
        assert cached > 0 and predicted == cached  # engine-counted hit, exactly predicted
    text = await (await http.get(gw.url + "/metrics")).text()
    for rank in (0, 1):
        assert metric_value(text, "llm_gateway_kv_events_applied_total", endpoint=f"{host(sim)}#dp{rank}") > 0
    async with http.get(gw.url + "/debug/endpoints") as resp:
        (row,) = (await resp.json())["endpoints"]
    assert [r["name"] for r in row["data_parallel_ranks"]] == [f"{host(sim)}#dp0", f"{host(sim)}#dp1"]
    assert row["healthy"] and all(r["healthy"] for r in row["data_parallel_ranks"])


async def test_load_spreads_across_ranks(start_sims, start_gateway, http) -> None:
    (sim,) = await start_sims(1, data_parallel_size=2, time_scale=5.0)
    gw = await start_gateway(gateway_config([sim.url], prefix={"exact": "off"}))
    await wait_ranks(gw, sim, 2, live=False)
    served = await asyncio.gather(*(ask(http, gw, document(100 + i), max_tokens=30) for i in range(12)))
    counts = {name: sum(1 for e, _, _ in served if e == name) for name in {e for e, _, _ in served}}
    assert len(counts) == 2 and min(counts.values()) >= 4, counts
    assert sim.state.dp is not None and min(sim.state.dp.picked) >= 4


async def test_a_single_rank_endpoint_is_routed_as_before(start_sims, start_gateway, http) -> None:
    (sim,) = await start_sims(1, kv_events=True)  # vLLM without DP still labels engine="0"
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_ranks(gw, sim, 1)
    (target,) = registry(gw).targets()
    assert target.dp_rank is None and target.replica is None and target.name == host(sim)
    endpoint, _, _ = await ask(http, gw, document(1))
    assert endpoint == host(sim)
    async with http.get(gw.url + "/debug/endpoints") as resp:
        assert "data_parallel_ranks" not in (await resp.json())["endpoints"][0]


async def test_events_of_another_rank_are_refused_and_counted(start_sims, start_gateway, http) -> None:
    (sim,) = await start_sims(1, data_parallel_size=2, kv_events=True)
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_ranks(gw, sim, 2)
    dp = sim.state.dp
    assert dp is not None
    name = f"{host(sim)}#dp1"
    stored = {"type": "BlockStored", "block_hashes": [77], "parent_block_hash": None,
              "token_ids": list(range(16)), "block_size": 16}  # fmt: skip
    for rank in (7, 0, -1):  # out of range, the other rank's, nonsense
        dp.publishers[1].inject([stored], rank=rank)
    exact = gw.gateway.app[STATE].prefix.exact  # type: ignore[union-attr]
    async with asyncio.timeout(5):
        while True:
            text = await (await http.get(gw.url + "/metrics")).text()
            if (metric_value(text, "llm_gateway_kv_events_decode_errors_total", endpoint=name) or 0) >= 3:
                break
            await asyncio.sleep(0.05)
    assert exact.index.size(name) == 0  # none of the foreign blocks was applied
    assert exact.index.live(name)  # the stream stays in sequence and live
    _, predicted, cached = await ask(http, gw, document(2))
    assert predicted == cached == 0


async def test_ranks_listed_that_never_publish_fall_back_to_the_approximate_index(
    start_sims, start_gateway, http
) -> None:
    (sim,) = await start_sims(1, data_parallel_size=2, kv_events=True)
    dp = sim.state.dp
    assert dp is not None
    await dp.publishers[1].close()  # listed in /kv_event_sources, publishes nothing
    listed = dp.sources
    dead = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:9", "topic": "kv-events"}
    dp.sources = lambda: {**listed(), "2": dead}  # type: ignore[method-assign]  # a rank the engine lacks
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_ranks(gw, sim, 2, live=False)
    exact = gw.gateway.app[STATE].prefix.exact  # type: ignore[union-attr]
    await asyncio.sleep(0.5)
    assert exact.index.live(f"{host(sim)}#dp0") and not exact.index.live(f"{host(sim)}#dp1")
    assert len(registry(gw).targets()) == 2  # the listed rank 2 is no target: the engine has 2 ranks
    for i in range(6):
        text = document(200 + i)
        await ask(http, gw, text)
        _, _, cached = await ask(http, gw, text + " again")
        assert cached > 0  # either rank: exact on rank 0, approximate on rank 1


async def test_a_restart_with_another_rank_count_is_followed(start_gateway, http, stack) -> None:
    config = SimConfig(port=0, time_scale=20.0, data_parallel_size=2, kv_events=True)
    runner, sim = await start_runner(config)
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_ranks(gw, sim, 2)
    await ask(http, gw, document(300))

    for size in (1, 3):  # the same port, a new server with another --data-parallel-size
        await runner.cleanup()
        async with asyncio.timeout(10):
            while registry(gw).candidates(MODEL):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        config.data_parallel_size = size
        runner, sim = await start_runner(config)
        await wait_ranks(gw, sim, size)
        served = {(await ask(http, gw, document(310 + i)))[0] for i in range(2 * size)}  # never a 400
        assert served <= {t.name for t in registry(gw).targets()}
        assert sim.state.dp is None or sum(sim.state.dp.picked) == 2 * size
    await runner.cleanup()


SLOW_WATCH = {"health": {"interval_s": 30.0}, "scrape": {"interval_s": 30.0}}  # neither sees a quick restart


async def test_a_quick_restart_with_fewer_ranks_loses_no_request(start_gateway, http, stack) -> None:
    """Restarted with fewer ranks between two health checks and two scrapes: a request sent to
    a rank the server no longer has gets vLLM's 400; the gateway asks the same server again
    without the header, and a scrape at once learns the new ranks (not the next round, 30 s on)."""
    config = SimConfig(port=0, time_scale=5.0, data_parallel_size=3)
    runner, sim = await start_runner(config)
    spent = {"retry_budget_ratio": 0.0, "retry_budget_min_per_s": 0.0}  # no retry: the re-send is none
    gw = await start_gateway(
        gateway_config([sim.url], prefix={"exact": "off"}, resilience=spent, **SLOW_WATCH)
    )
    await wait_ranks(gw, sim, 3, live=False)
    await runner.cleanup()
    config.data_parallel_size = 2
    runner, sim = await start_runner(config)
    stack.push_async_callback(runner.cleanup)

    served = await asyncio.gather(*(ask(http, gw, document(600 + i), max_tokens=20) for i in range(9)))
    assert len(served) == 9  # every one answered 200 (ask asserts it)
    text = await (await http.get(gw.url + "/metrics")).text()
    refused = metric_value(text, "llm_gateway_retries_total", reason="rank_refused")
    assert refused and refused >= 1  # the load spread reached the gone rank, and it was refused
    assert sim.state.dp is not None and sum(sim.state.dp.picked) == 9  # each served once
    await wait_ranks(gw, sim, 2, live=False)  # learned again within the 10 s wait, not 30 s on
    assert {(await ask(http, gw, document(620 + i)))[0] for i in range(4)} <= {
        f"{host(sim)}#dp0",
        f"{host(sim)}#dp1",
    }


async def test_configured_ranks_the_server_does_not_have_are_re_sent_without_the_header(
    start_sims, start_gateway, http
) -> None:
    """A configured ``data_parallel_size`` is kept (the config is wrong, and logged), but no
    request fails for it: a refused rank is asked again without the header."""
    (sim,) = await start_sims(1, time_scale=5.0, data_parallel_size=2)  # vLLM refuses ranks 2 and 3
    config = gateway_config([sim.url], prefix={"exact": "off"}, scrape={"enabled": False})
    config = config.model_copy(
        update={"endpoints": [config.endpoints[0].model_copy(update={"data_parallel_size": 4})]}
    )
    gw = await start_gateway(config)
    await wait_ranks(gw, sim, 4, live=False)
    served = []
    for wave in range(3):  # far past the retry budget (20 % of requests + 5/s): the re-sends are free
        served += await asyncio.gather(*(ask(http, gw, document(700 + 100 * wave + i)) for i in range(100)))
    endpoints = {endpoint for endpoint, _, _ in served}
    assert endpoints <= {f"{host(sim)}#dp0", f"{host(sim)}#dp1", host(sim)}
    assert host(sim) in endpoints  # requests for ranks 2 and 3, answered by the server itself
    text = await (await http.get(gw.url + "/metrics")).text()
    assert metric_value(text, "llm_gateway_upstream_errors_total", endpoint=f"{host(sim)}#dp3") >= 1
    assert [t.dp_rank for t in registry(gw).targets()] == [0, 1, 2, 3]  # configured: kept


async def test_configured_ranks_route_from_the_first_request(start_sims, start_gateway, http) -> None:
    (sim,) = await start_sims(1, data_parallel_size=2)
    config = gateway_config([sim.url], prefix={"exact": "off"}, scrape={"enabled": False})
    config = config.model_copy(
        update={"endpoints": [config.endpoints[0].model_copy(update={"data_parallel_size": 2})]}
    )
    gw = await start_gateway(config)
    await wait_ranks(gw, sim, 2, live=False)
    served = {(await ask(http, gw, document(400 + i)))[0] for i in range(6)}
    assert served <= {f"{host(sim)}#dp0", f"{host(sim)}#dp1"} and served
    assert sim.state.dp is not None and sum(sim.state.dp.picked) == 6


async def test_a_session_stays_on_its_rank(start_sims, start_gateway, http) -> None:
    (sim,) = await start_sims(1, data_parallel_size=2, time_scale=5.0)
    gw = await start_gateway(gateway_config([sim.url], prefix={"exact": "off"}, policy="session-aware"))
    await wait_ranks(gw, sim, 2, live=False)
    pinned: dict[str, set[str]] = {}
    for turn in range(4):
        for session in ("alpha", "beta", "gamma", "delta"):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{session} {turn}"}],
                "max_tokens": 2,
            }
            headers = {"x-session-id": session, "x-gateway-debug": "1"}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                pinned.setdefault(session, set()).add(r.headers["x-gateway-endpoint"])
    assert all(len(served) == 1 for served in pinned.values()), pinned  # pinned to (replica, rank)
    assert all(next(iter(s)).startswith(host(sim) + "#dp") for s in pinned.values())


async def test_a_retry_goes_to_another_server_before_another_rank(start_sims, start_gateway, http) -> None:
    (failing,) = await start_sims(1, data_parallel_size=2)
    (other,) = await start_sims(1)
    # Breakers that never trip: every request must be saved by its one retry, not by an ejection.
    never = {"consecutive_failures": 1000, "min_requests": 1000}
    gw = await start_gateway(
        gateway_config([failing.url, other.url], prefix={"exact": "off"}, resilience=never)
    )
    await wait_ranks(gw, failing, 2, live=False)
    failing.state.fault.mode, failing.state.fault.status = "error", 503  # every rank of it fails
    served = [(await ask(http, gw, document(500 + i)))[0] for i in range(12)]
    assert served == [host(other)] * 12  # a single retry (the default) always reached the other server
    text = await (await http.get(gw.url + "/metrics")).text()
    assert (metric_value(text, "llm_gateway_retries_total") or 0) >= 1


def test_attempt_order_puts_other_servers_before_sibling_ranks() -> None:
    from gateway.fleet.dp import other_servers_first, set_ranks
    from gateway.fleet.endpoint import Endpoint

    a, b = Endpoint("http://a:1", healthy=True), Endpoint("http://b:1", healthy=True)
    set_ranks(a, [0, 1])
    a0, a1 = a.rank_targets
    assert other_servers_first([a0, a1, b]) == [a0, b, a1]
    assert other_servers_first([b, a1, a0]) == [b, a1, a0]
