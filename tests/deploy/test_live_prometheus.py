"""A real Prometheus scraping real gateways, evaluating the dashboard's queries and the alerting rules.

Eight gateways (seven in-process, one ``serve --workers 2``) run in front of simulated
replicas under light load, each built to make one alert's condition true for real, and one
real ``prometheus`` (Debian's package)
scrapes them every second and evaluates a test copy of ``deploy/prometheus/rules.yaml``
(``prom_live.fast_rules``: the same expressions and thresholds; only the evaluation
interval, the range windows and the ``for:`` durations shrink, per its tables):

==========  =====================================================  ====================================
gateway     fault (then undone)                                    alert that must fire (and only it)
==========  =====================================================  ====================================
main        a rejected config reload (the reloader's real path),   LLMGatewayConfigReloadRejected,
            a discovered replica's pod turns NotReady, then the    DiscoveryFailing
            API server fails every LIST and closes the watch
down        its only replica killed, restarted on its port         NoHealthyEndpoints, MetricsStale
eject       one replica answers 500, the other is fine             EndpointEjected
retry       one replica answers 500, breaker off, budget zero      RetryBudgetExhausted
overload    40 long generations at once on one small replica       HighShedRate (and desired > current)
redis       its own redis-server SIGKILLed, restarted              RedisFallbacksRising (zero 5xx)
pd          one prefill replica hands over no KV, the other 500s   PDSilentlyDegraded (and the 500ing
                                                                   prefill replica may be ejected)
workers     ``serve --workers 2`` (a process of its own): its      WorkerRespawned, WorkersDown
            endpoint's API key file removed and a worker
            SIGKILLed: the replacements fail until it is back
==========  =====================================================  ====================================

Before the faults no alert fires; during them exactly the expected ones fire; after them
all resolve. Every Grafana panel query returns series, and every rule evaluates healthily
and (recording rules) produces series. Under CI a missing ``prometheus`` fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.http.reload import ConfigReloader
from loadtest.harness.processes import ManagedProcess
from loadtest.harness.redis_server import RedisServer
from tests.deploy.live_fleet import Load, Replica, ResponsesLoad, long_request, tenant_request, write_keys
from tests.deploy.prom_live import binary, dashboard_queries, fast_rules, running_prometheus
from tests.fleet.discovery.apiserver import make_pod, running_apiserver
from tests.support.harness import Gateway, running_gateway
from tests.support.workers import spawn_gateway, worker_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def host(gw: Gateway | ManagedProcess) -> str:
    return gw.url.removeprefix("http://")


def matches(alert: dict[str, Any], name: str, labels: dict[str, str]) -> bool:
    return alert["labels"]["alertname"] == name and all(
        alert["labels"].get(k) == v for k, v in labels.items()
    )


def describe(alerts: list[dict[str, Any]]) -> list[str]:
    return sorted(
        "{}{}".format(a["labels"]["alertname"], {k: v for k, v in a["labels"].items() if k != "alertname"})
        for a in alerts
    )


async def test_dashboards_rules_and_alerts_on_a_live_prometheus(http, stack, tmp_path: Path) -> None:
    binary("prometheus")
    t0 = time.monotonic()
    started: list[Replica] = []

    async def replica(**config: Any) -> Replica:
        r = await Replica(**config).start()
        started.append(r)
        return r

    async def stop_replicas() -> None:
        for r in started:
            await r.stop()

    stack.push_async_callback(stop_replicas)

    async def gateway(endpoints: list[Any], **overrides: Any) -> Gateway:
        return await stack.enter_async_context(running_gateway(endpoints, **overrides))

    keys = write_keys(tmp_path / "keys.yaml")
    auth = {"enabled": True, "backend": "file", "keys_file": str(keys)}
    redis = await RedisServer(log_dir=tmp_path).start_async()
    stack.push_async_callback(redis.kill_async)

    # main: sessions pinned, a small KV cache (long prompts evict it), its second replica a pod
    # found by Kubernetes discovery (a local API server speaking the watch protocol).
    main_r = [await replica(kv_blocks=160), await replica(kv_blocks=160)]
    api = await stack.enter_async_context(running_apiserver("llm"))
    (tmp_path / "token").write_text("sa-token")
    pod = {"labels": {"app": "sim"}, "annotations": {"llm-gateway.io/port": str(main_r[1].port)}}
    api.put(make_pod("sim-1", "127.0.0.1", **pod))
    k8s = {"namespace": "llm", "label_selector": "app=sim", "api_server": api.url,
           "token_file": str(tmp_path / "token"), "ca_file": None}  # fmt: skip
    main = await gateway([main_r[0].url], auth=auth, policy="session-aware", discovery={"kubernetes": k8s})
    down_r = await replica()
    down = await gateway([down_r.url])
    eject_r = [await replica(), await replica()]
    eject = await gateway(
        [r.url for r in eject_r],
        policy="round-robin",  # the faulty replica keeps getting its share (no prefix/session pull)
        resilience={"ejection_s": 6.0, "max_ejection_s": 12.0},
    )
    retry_r = [await replica(), await replica()]
    retry = await gateway(
        [r.url for r in retry_r],
        policy="round-robin",
        resilience={
            "consecutive_failures": 1_000_000,
            "error_rate": 1.0,
            "min_requests": 1_000_000,
            "retry_budget_ratio": 0.0,
            "retry_budget_min_per_s": 0.0,
        },
    )
    over_r = await replica(max_num_seqs=2, time_scale=10.0)
    overload = await gateway(
        [over_r.url],
        admission={"queue_depth_threshold": 1, "max_queue": 1, "queue_timeout_s": 0.3},
    )
    redis_r = [await replica(), await replica()]
    # 100 ms budgets, not the 5 ms defaults: seven gateways share this test's one event loop on a
    # busy box, and a 5 ms budget there times out (and counts fallbacks) with Redis up.
    on_redis = {"backend": "redis", "redis_url": redis.url, "key_prefix": "live", "redis_budget_s": 0.1}
    redis_gw = await gateway(
        [r.url for r in redis_r],
        prefix=on_redis,
        sessions=on_redis,
        policy="session-aware",
        auth={
            **auth,
            "limits_backend": "redis",
            "redis_url": redis.url,
            "key_prefix": "live",
            "redis_budget_s": 0.1,
        },
    )
    prefill = await replica(role="prefill")
    prefill_2 = await replica(role="prefill")
    decode = await replica(role="decode")
    pd = await gateway(
        [
            {"url": prefill.url, "role": "prefill"},
            {"url": prefill_2.url, "role": "prefill"},
            {"url": decode.url, "role": "decode"},
        ],
        pd={"decider": "always"},
    )
    workers_r = await replica()
    workers_key = tmp_path / "workers-token"
    workers_key.write_text("token\n")
    workers_config = tmp_path / "workers.yaml"
    workers_config.write_text(
        f"endpoints:\n  - url: {workers_r.url}\n    models: [m]\n    api_key_file: {workers_key}\n"
    )
    workers = await spawn_gateway([], ["--workers", "2", "--config", str(workers_config)], tmp_path,
                                  name="workers")  # fmt: skip
    stack.push_async_callback(workers.stop)
    gateways = {"main": main, "down": down, "eject": eject, "retry": retry, "overload": overload,
                "redis": redis_gw, "pd": pd, "workers": workers}  # fmt: skip

    config_file = tmp_path / "gateway.yaml"
    config_file.write_text("endpoints: []\n")
    reloader = ConfigReloader(main.state, config_file)

    loads = {
        "main": Load(http, main.url, request=tenant_request, workers=2),
        "main-responses": ResponsesLoad(http, main.url),
        "down": Load(http, down.url, pause_s=0.5),
        "eject": Load(http, eject.url),
        "retry": Load(http, retry.url),
        "overload": Load(http, overload.url, pause_s=0.5),
        "redis": Load(http, redis_gw.url, request=tenant_request),
        "pd": Load(http, pd.url, pause_s=0.5),
        "workers": Load(http, workers.url, pause_s=0.2),
    }
    burst = Load(http, overload.url, request=long_request, workers=40, pause_s=0.0)
    for load in loads.values():
        stack.push_async_callback(load.stop)
        load.start()
    stack.push_async_callback(burst.stop)

    prom = await stack.enter_async_context(
        running_prometheus([host(g) for g in gateways.values()], tmp_path, fast_rules())
    )
    report: list[str] = [f"started in {time.monotonic() - t0:.1f}s"]

    async def poll(done, deadline_s: float, what: str) -> float:
        begin = time.monotonic()
        while not await done():
            if time.monotonic() - begin > deadline_s:
                raise AssertionError(f"{what}: not within {deadline_s}s\n{prom.log_tail()}")
            await asyncio.sleep(0.5)
        return time.monotonic() - begin

    async def all_up() -> bool:
        return await prom.targets_up() == len(gateways)

    await poll(all_up, 20, "every gateway scraped")

    # -- baseline: nothing fires -------------------------------------------------------------
    firing_seen: list[dict[str, Any]] = []
    begin = time.monotonic()
    while time.monotonic() - begin < 12:
        firing_seen += await prom.alerts()
        await asyncio.sleep(1)
    assert firing_seen == [], f"alerts firing with no fault: {describe(firing_seen)}"

    # -- faults ------------------------------------------------------------------------------
    for load in [*loads.values(), burst]:
        load.phase = "fault"
    fault_at = time.monotonic()
    config_file.write_text("server: {port: not-a-port}\n")
    assert await reloader.reload() == "rejected"
    await down_r.stop()
    await eject_r[1].fault(http, "error", status=500)
    await retry_r[1].fault(http, "error", status=500)
    burst.start()
    await redis.kill_async()
    await prefill.fault(http, "no_transfer")
    await prefill_2.fault(http, "error", status=500)
    api.put(make_pod("sim-1", "127.0.0.1", ready=False, **pod))  # a replica leaves: no alert
    api.list_status = 500  # then the API server fails (after that change): every re-list fails
    api.close()
    workers_key.unlink()  # a replacement cannot load its config until the file is back
    os.kill(min(worker_pids(workers.pid)), signal.SIGKILL)

    expected: dict[str, dict[str, str]] = {
        "LLMGatewayConfigReloadRejected": {"instance": host(main)},
        "LLMGatewayDiscoveryFailing": {"instance": host(main)},
        "LLMGatewayNoHealthyEndpoints": {"instance": host(down)},
        "LLMGatewayEndpointMetricsStale": {"instance": host(down), "endpoint": down_r.name},
        "LLMGatewayEndpointEjected": {"instance": host(eject), "endpoint": eject_r[1].name},
        "LLMGatewayRetryBudgetExhausted": {"instance": host(retry)},
        "LLMGatewayHighShedRate": {},
        "LLMGatewayRedisFallbacksRising": {},
        "LLMGatewayPDSilentlyDegraded": {"reason": "no_transfer_params"},
        "LLMGatewayWorkerRespawned": {"instance": host(workers)},
        "LLMGatewayWorkersDown": {"instance": host(workers)},
    }
    # Explained without being required: a prefill replica that answers 500 feeds its breaker
    # like any replica (13ca0a5), so it may be ejected too.
    explained = [
        *expected.items(),
        ("LLMGatewayEndpointEjected", {"instance": host(pd), "endpoint": prefill_2.name}),
    ]
    assert set(expected) == {r["alert"] for r in fast_rules()["groups"][1]["rules"]}
    fired_after: dict[str, float] = {}
    unexpected: list[dict[str, Any]] = []

    async def all_fired() -> bool:
        firing = await prom.alerts()
        for name, labels in expected.items():
            if name not in fired_after and any(matches(a, name, labels) for a in firing):
                fired_after[name] = time.monotonic() - fault_at
        unexpected.extend(a for a in firing if not any(matches(a, n, lb) for n, lb in explained))
        return len(fired_after) == len(expected)

    try:
        await poll(all_fired, 60, "every alert firing")
    finally:
        report.append(f"fired: {fired_after}")
        print("\n".join(report), f"\nfiring now: {describe(await prom.alerts())}")
    assert unexpected == [], f"alerts firing that no fault explains: {describe(unexpected)}"

    # Overload also shows as scale-out demand on the autoscaling signal. Over the fault window,
    # not at one instant: desired follows the engine's waiting queue at the gateway's last
    # scrape, and with the gateway shedding down to max_queue 1 that queue is sometimes empty
    # at the instant of the query (CI saw desired = current = 1 once).
    over = f'{{instance="{host(overload)}"}}'
    window = f"[{math.ceil(time.monotonic() - fault_at) + 1}s]"
    desired = await prom.query(f"max(max_over_time(llm_gateway_pool_desired_replicas{over}{window}))")
    current = await prom.query(f"max(max_over_time(llm_gateway_pool_current_replicas{over}{window}))")
    report.append(f"overload desired/current replicas: {desired} / {current}")
    assert desired and current and float(desired[0]["value"][1]) > float(current[0]["value"][1])

    # Every panel's query and every rule, while every kind of series exists.
    empty = []
    for dashboard, title, expr in dashboard_queries():
        if not await prom.query(expr):
            empty.append(f"{dashboard}: {title}: {expr}")
    rules = await prom.rules()
    unhealthy = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert unhealthy == []
    for rule in (r for r in rules if r["type"] == "recording"):
        if not await prom.query(rule["name"]):
            empty.append(f"recording rule {rule['name']}")
    assert empty == [], "queries without series:\n" + "\n".join(empty)
    # The Responses panel is fed by real chains: continuations found in the store.
    hits = await prom.query(
        f'sum(llm_gateway_response_lookups_total{{instance="{host(main)}",result="hit"}})'
    )
    assert hits and float(hits[0]["value"][1]) > 0, hits

    # -- recovery ----------------------------------------------------------------------------
    for load in loads.values():
        load.phase = "recovered"
    recover_at = time.monotonic()
    await burst.stop()
    await down_r.start()
    await eject_r[1].fault(http, "none")
    await retry_r[1].fault(http, "none")
    await redis.start_async()
    await prefill.fault(http, "none")
    await prefill_2.fault(http, "none")
    api.list_status = 200
    api.put(make_pod("sim-1", "127.0.0.1", **pod))
    workers_key.write_text("token\n")
    resolved_after: dict[str, float] = {}

    async def all_resolved() -> bool:
        firing = {a["labels"]["alertname"] for a in await prom.alerts()}
        for name in expected:
            if name not in firing and name not in resolved_after:
                resolved_after[name] = time.monotonic() - recover_at
        return not firing

    try:
        await poll(all_resolved, 60, "every alert resolved")
    finally:
        report.append(f"resolved: {resolved_after}")
        report.append(f"statuses: { {k: dict(v.statuses) for k, v in loads.items()} }")
        print("\n".join(report))

    # The gateways whose faults are behind Redis or a config file never answered 5xx.
    for name in ("main", "main-responses", "redis"):
        assert loads[name].count(500, 600) == 0, (name, loads[name].statuses)
    with contextlib.suppress(Exception):
        config_file.unlink()
