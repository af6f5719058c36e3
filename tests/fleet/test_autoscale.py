"""Autoscaling signals: ``llm_gateway_pool_desired_replicas`` follows the engines' load."""

from __future__ import annotations

import asyncio
import math

from gateway.config import AutoscaleConfig
from gateway.fleet.autoscale import pool_signals
from gateway.fleet.dp import rank_target
from gateway.fleet.endpoint import Endpoint, Role
from tests.support.harness import gateway_metrics, metric_value, wait_until

CONFIG = AutoscaleConfig(kv_target=0.5, queue_target=2.0, headroom=0.2)


def _endpoint(n: int, *, role: Role = Role.BOTH, kv: float | None = 0.0, waiting: float | None = 0.0,
              fresh: bool = True, healthy: bool = True) -> Endpoint:  # fmt: skip
    e = Endpoint(url=f"http://10.0.0.{n}:8000", role=role, configured_models=frozenset({"m"}))
    e.healthy = healthy
    e.metrics.kv_usage, e.metrics.waiting = kv, waiting
    e.metrics.scraped_at, e.metrics.stale = (1.0, False) if fresh else (0.0, True)
    return e


def test_pressure_is_the_larger_of_kv_and_queue_over_their_targets() -> None:
    fleet = [_endpoint(1, kv=0.5), _endpoint(2, kv=0.25, waiting=4), _endpoint(3, kv=0.1)]
    (signal,) = pool_signals(fleet, CONFIG)
    # pressures 1.0 + max(0.5, 2.0) + 0.2 = 3.2; with 20 % headroom: 3.2 / 0.8 = 4 replicas
    assert (signal.pool, signal.current, signal.desired) == ("both", 3, 4)
    assert math.isclose(signal.kv_utilization, (0.5 + 0.25 + 0.1) / 3)
    assert signal.queue_depth == 4


def test_pools_are_separate_and_unhealthy_replicas_do_not_count() -> None:
    fleet = [
        _endpoint(1, role=Role.PREFILL, waiting=6),
        _endpoint(2, role=Role.DECODE, kv=0.1),
        _endpoint(3, role=Role.DECODE, kv=0.1, healthy=False),
    ]
    signals = {s.pool: s for s in pool_signals(fleet, CONFIG)}
    assert signals["prefill"].desired == 4  # 6 / 2 = 3.0 → / 0.8 → 3.75 → 4
    assert (signals["decode"].current, signals["decode"].desired) == (1, 1)  # never below one


def test_stale_replicas_count_as_at_target() -> None:
    (signal,) = pool_signals([_endpoint(1, fresh=False), _endpoint(2, fresh=False)], CONFIG)
    assert signal.desired == 3  # 2 × 1.0 / 0.8 = 2.5 → 3: neither collapses nor explodes


def test_a_data_parallel_replica_is_one_replica_of_its_ranks_mean_pressure() -> None:
    fleet = []
    for n in (1, 2):
        pod = _endpoint(n)
        pod.rank_targets = tuple(rank_target(pod, r) for r in range(4))
        for rank in pod.rank_targets:  # every rank exactly at the KV target
            rank.metrics.kv_usage, rank.metrics.waiting = 0.5, 0.0
            rank.metrics.scraped_at, rank.metrics.stale = 1.0, False
        fleet.append(pod)
    (signal,) = pool_signals(fleet, CONFIG)
    assert (signal.current, signal.desired) == (2, 3)  # 2 × 1.0 / 0.8 → 3, not 8 → 10
    assert signal.kv_utilization == 0.5


async def test_the_exported_pool_counts_replicas_not_their_ranks(start_sim, start_gateway, http) -> None:
    sims = [await start_sim(model="m", data_parallel_size=4) for _ in range(2)]
    gw = await start_gateway([s.url for s in sims], scrape={"interval_s": 0.1})

    async def ranks_learned() -> bool:
        return len(gw.state.registry.targets()) == 8

    await wait_until(ranks_learned, 5.0, "both replicas' four ranks")
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_pool_current_replicas", pool="both") == 2


async def test_desired_replicas_follow_simulated_load(start_sim, start_gateway, http) -> None:
    sims = [await start_sim(max_num_seqs=1, time_scale=5) for _ in range(2)]
    model = sims[0].config.model
    gw = await start_gateway(
        [s.url for s in sims],
        scrape={"interval_s": 0.1, "timeout_s": 0.5},
        autoscale={"kv_target": 0.7, "queue_target": 2.0, "headroom": 0.1},
        admission={"enabled": False},
    )

    async def desired() -> float | None:
        return metric_value(await gateway_metrics(http, gw), "llm_gateway_pool_desired_replicas", pool="both")

    async def idle() -> bool:
        return await desired() == 1

    await wait_until(idle, within_s=3, what="idle fleet wants one replica")

    async def one(i: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": f"load {i}"}], "max_tokens": 200}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()

    load = [asyncio.create_task(one(i)) for i in range(16)]  # 1 slot per replica: the rest queue
    try:

        async def busy() -> bool:
            value = await desired()
            return value is not None and value > 2

        await wait_until(busy, within_s=5, what="queued load asks for more replicas")
        text = await gateway_metrics(http, gw)
        assert metric_value(text, "llm_gateway_pool_current_replicas", pool="both") == 2
        assert (metric_value(text, "llm_gateway_pool_queue_depth", pool="both") or 0) > 0
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    await wait_until(idle, within_s=5, what="desired replicas fall back when the load ends")
