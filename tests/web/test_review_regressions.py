"""Regression tests for review findings r1–r10 (+ /debug/endpoints, body priority, SIGHUP).

Each test reproduces what a reviewer showed going wrong, over real sockets against a
real in-process gateway (or a real ``llm-gateway serve`` process), and asserts the
behaviour that must hold now.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.auth import hash_key
from gateway.config import ConfigError, EndpointConfig
from gateway.fleet.membership import ADMIN_SOURCE, CONFIG_SOURCE
from gateway.http.reload import apply_config
from loadtest.fleet import start_gateway as start_gateway_process
from tests.support.harness import chat_body, gateway_metrics, metric_value, wait_until
from tests.support.upstreams import Upstream, vllm_metrics

# Health probes that never flip on their own: only what real requests see matters here.
STICKY_HEALTH = {"interval_s": 60, "unhealthy_threshold": 100}
ADMIN_KEY = "admin-secret-r"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_SHA = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
TENANT_KEY = "sk-tenant"


def keys_yaml(path, **tenant: Any) -> str:
    """A keys file with one tenant ``t`` (``tenant``: its limits) holding ``TENANT_KEY``."""
    path.write_text(
        yaml.safe_dump({"tenants": {"t": tenant}, "keys": [{"sha256": hash_key(TENANT_KEY), "tenant": "t"}]})
    )
    return str(path)


async def post_chat(http: aiohttp.ClientSession, gw, headers=None, **extra) -> tuple[int, str | None]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(**extra), headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-gateway-endpoint")


async def ejections(http, gw, endpoint: str | None = None) -> float:
    labels = {} if endpoint is None else {"endpoint": endpoint}
    text = await gateway_metrics(http, gw)
    return metric_value(text, "llm_gateway_endpoint_ejections_total", **labels) or 0.0


class HeldThen500(Upstream):
    """Non-streamed requests wait for ``gate``, then fail with a 500 (in-flight failures on demand)."""

    async def _complete(self, request: web.Request, chat: bool, model: str) -> web.StreamResponse:
        if self.mode == "held-500":
            await self.gate.wait()
            return web.Response(status=500, body=self.body, content_type="application/json")
        return await super()._complete(request, chat, model)


async def start_own(stack, cls: type[Upstream]) -> Upstream:
    upstream = cls()
    await upstream.start()
    stack.push_async_callback(upstream.stop)
    return upstream


class SlowUpstream(Upstream):
    """Answers non-streamed requests correctly, but only after ``delay_s`` (a long generation)."""

    delay_s = 0.8

    async def _complete(self, request: web.Request, chat: bool, model: str) -> web.StreamResponse:
        await asyncio.sleep(self.delay_s)
        return await super()._complete(request, chat, model)


# ---- r1: an abandoned half-open probe -------------------------------------------------


async def test_abandoned_half_open_probe_does_not_leave_the_endpoint_ejected(
    start_upstream, start_gateway, http
):
    flaky, good = await start_upstream(), await start_upstream()
    flaky.mode, flaky.status = "status", 500
    gw = await start_gateway(
        [flaky.url, good.url],
        policy="round-robin",
        health=STICKY_HEALTH,
        resilience={"ejection_s": 0.5, "max_ejection_s": 4, "check_interval_s": 0.05, "stall_s": 30},
    )
    endpoint = gw.state.registry.get(flaky.url)
    for _ in range(6):
        assert (await post_chat(http, gw))[0] == 200
    assert endpoint.ejected
    await wait_until(lambda: asyncio.sleep(0, not endpoint.ejected), 2.0, "half-open")

    flaky.mode = "hold"  # the probe hangs, and its client gives up: no verdict at all
    before = len(flaky.requests)
    for _ in range(4):
        with contextlib.suppress(TimeoutError):
            async with http.post(
                gw.url + "/v1/chat/completions", json=chat_body(), timeout=aiohttp.ClientTimeout(total=0.3)
            ) as resp:
                await resp.read()
        if len(flaky.requests) > before:
            break
    assert len(flaky.requests) == before + 1, "the probe never reached the half-open endpoint"
    await wait_until(lambda: asyncio.sleep(0, flaky.cancelled.is_set()), 2.0, "the probe to be cut")

    # Old behaviour: `probing` stayed set and the endpoint stayed ejected for good.
    await wait_until(lambda: asyncio.sleep(0, not endpoint.ejected), 1.0, "the endpoint back in rotation")
    flaky.mode = "ok"
    served = [(await post_chat(http, gw))[1] for _ in range(4)]
    assert flaky.name in served  # another request could probe, and it closed the breaker
    assert gw.state.breakers.state(endpoint) == "closed"


# ---- r10: no metrics, slow non-streamed answers -------------------------------------------


async def test_slow_replica_without_metrics_is_not_called_stalled(stack, start_gateway, http):
    slow = [await start_own(stack, SlowUpstream) for _ in range(2)]
    gw = await start_gateway(
        [u.url for u in slow],
        policy="round-robin",
        health=STICKY_HEALTH,
        scrape={"enabled": False},
        resilience={"stall_s": 0.2, "check_interval_s": 0.05, "ejection_s": 30},
    )
    status, served_by = await post_chat(http, gw)
    assert status == 200
    # Old behaviour: no fresh metrics and no first byte yet → "stalled" after 0.2 s, ejected,
    # and the request re-sent to the other replica.
    assert sum(len(u.requests) for u in slow) == 1
    assert not any(e.ejected for e in gw.state.registry)
    assert await ejections(http, gw) == 0
    assert served_by in {u.name for u in slow}


# ---- r7: requests queued in the gateway's own connection pool -----------------------------


async def test_requests_queued_in_the_gateways_pool_are_not_stall_evidence(
    start_upstream, start_gateway, http
):
    # Two busy-but-fine replicas: each honestly reports the 2 requests it is running.
    a = await start_upstream(metrics_text=vllm_metrics(running=2))
    b = await start_upstream(metrics_text=vllm_metrics(running=2))
    a.mode = b.mode = "hold"  # long non-streamed generations: no header until done
    gw = await start_gateway(
        [a.url, b.url],
        policy="round-robin",
        health=STICKY_HEALTH,
        scrape={"interval_s": 0.1, "timeout_s": 0.1},
        limits={"upstream_connections_per_endpoint": 2},
        resilience={"stall_s": 0.3, "check_interval_s": 0.05, "ejection_s": 30},
    )
    await wait_until(
        lambda: asyncio.sleep(0, all(e.metrics.fresh() for e in gw.state.registry)), 2.0, "scrapes"
    )
    tasks = [asyncio.create_task(post_chat(http, gw)) for _ in range(6)]  # 3 per replica, pool of 2
    try:
        await wait_until(lambda: asyncio.sleep(0, len(a.requests) + len(b.requests) == 4), 2.0, "4 sent")
        await asyncio.sleep(1.0)  # > 3 stall windows, several scrapes
        assert (len(a.requests), len(b.requests)) == (2, 2)  # the other two wait in the gateway's pool
        assert not any(e.ejected for e in gw.state.registry)
        assert await ejections(http, gw) == 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- r6: max_ejected_fraction counts endpoints already out --------------------------------


@pytest.mark.parametrize("second_out", ["down", "draining"])
async def test_ejection_share_counts_endpoints_down_or_draining(
    start_upstream, start_gateway, http, second_out
):
    d1, d2, b1, b2 = [await start_upstream() for _ in range(4)]
    d1.healthy = False
    if second_out == "down":
        d2.healthy = False
    for bad in (b1, b2):
        bad.mode, bad.status = "status", 500
    gw = await start_gateway(
        [{"url": u.url, "models": ["tiny"]} for u in (d1, d2, b1, b2)],  # all four count as peers
        policy="round-robin",
        auth={"admin_key_sha256": ADMIN_SHA},
        health={"interval_s": 0.1, "unhealthy_threshold": 1},
        resilience={"ejection_s": 30, "check_interval_s": 0.05, "max_ejected_fraction": 0.5},
    )
    registry = gw.state.registry
    if second_out == "draining":
        async with http.post(gw.url + "/admin/endpoints/drain", json={"url": d2.url}, headers=ADMIN) as resp:
            assert resp.status == 200

    def settled() -> bool:
        down = [registry.get(d1.url), *([registry.get(d2.url)] if second_out == "down" else [])]
        return not any(e.healthy for e in down) and all(registry.get(u.url).healthy for u in (b1, b2))

    await wait_until(lambda: asyncio.sleep(0, settled()), 3.0, "health checks to settle")
    # Two of four are out already; with max_ejected_fraction 0.5 neither failing one may go too.
    statuses = [(await post_chat(http, gw))[0] for _ in range(10)]
    assert set(statuses) == {500}  # the engines' own 500s, never the gateway's 503
    assert not registry.get(b1.url).ejected and not registry.get(b2.url).ejected
    assert len(b1.requests) + len(b2.requests) >= 10
    text = await gateway_metrics(http, gw)
    assert (metric_value(text, "llm_gateway_endpoint_ejections_skipped_total") or 0) >= 1


# ---- r2: admin add with api_key_file; an add that cannot be built ---------------------------


async def test_admin_add_refuses_api_key_file_and_a_failed_add_changes_nothing(
    start_upstream, start_gateway, http, tmp_path
):
    a, evil, c, d = [await start_upstream() for _ in range(4)]
    gw = await start_gateway([a.url], auth={"admin_key_sha256": ADMIN_SHA}, health=STICKY_HEALTH)
    state = gw.state
    secret = tmp_path / "sa-token"
    secret.write_text("gateway-local-secret\n")

    add = gw.url + "/admin/endpoints"
    for key_file in (str(secret), str(tmp_path / "missing")):
        async with http.post(add, json={"url": evil.url, "api_key_file": key_file}, headers=ADMIN) as resp:
            assert resp.status == 400  # old: 201 with the local file as evil's bearer token (or a 500)
            assert "api_key_file" in (await resp.json())["error"]["message"]
    assert state.registry.get(evil.url) is None and state.membership.source_of(evil.url) is None

    async with http.post(add, json={"url": c.url}, headers=ADMIN) as resp:  # later adds still work
        assert resp.status == 201
    await apply_config(state, state.config.model_copy(update={"policy": "round-robin"}))  # and reloads
    assert state.config.policy == "round-robin"

    # A list with one entry that cannot be built (its token file is unreadable) is refused whole.
    urls_before = {e.url for e in state.registry}
    admin_before = state.membership.endpoints_of(ADMIN_SOURCE)
    broken = EndpointConfig(url="http://127.0.0.1:9", api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="api_key_file"):
        state.membership.apply(ADMIN_SOURCE, [*admin_before, EndpointConfig(url=d.url), broken])
    assert {e.url for e in state.registry} == urls_before  # old: d.url was half-added
    assert state.membership.endpoints_of(ADMIN_SOURCE) == admin_before
    state.membership.apply(CONFIG_SOURCE, state.membership.endpoints_of(CONFIG_SOURCE))  # old: raised
    async with http.post(add, json={"url": d.url}, headers=ADMIN) as resp:
        assert resp.status == 201


# ---- r3a: a reload with a broken keys file is rejected whole ------------------------------


async def test_reload_with_a_broken_keys_file_changes_nothing(start_upstream, start_gateway, http, tmp_path):
    a, b = await start_upstream(), await start_upstream()
    keys = tmp_path / "keys.yaml"
    gw = await start_gateway([a.url], auth={"enabled": True, "keys_file": keys_yaml(keys)})
    state = gw.state
    scheduler, config = state.routing.scheduler, state.config
    assert config.policy != "round-robin"

    keys.write_text("tenants: [broken\n")
    new = config.model_copy(
        update={"policy": "round-robin", "endpoints": [*config.endpoints, EndpointConfig(url=b.url)]}
    )
    with pytest.raises(ConfigError, match="keys_file"):
        await apply_config(state, new)
    # Old behaviour: the scheduler and the fleet had already changed when the keys file failed.
    assert state.routing.scheduler is scheduler
    assert state.config is config
    assert [e.url for e in state.registry] == [a.url]
    assert state.membership.endpoints_of(CONFIG_SOURCE) == config.endpoints
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    assert (await post_chat(http, gw, headers=auth))[0] == 200  # the keys in force still work


# ---- r3b: rotating an endpoint's api_key keeps it routable ----------------------------------


async def test_reload_changing_only_the_api_key_keeps_the_endpoint_routable(
    start_upstream, start_gateway, http
):
    a = await start_upstream()
    gw = await start_gateway([{"url": a.url, "api_key": "old-token"}])
    state = gw.state
    await wait_until(lambda: asyncio.sleep(0, state.registry.get(a.url).healthy), 2.0, "first probe")

    seen: list[tuple[bool, bool]] = []  # (healthy, routable) at every loop turn during the reload
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            endpoint = state.registry.get(a.url)
            routable = endpoint in state.registry.candidates("tiny")
            seen.append((endpoint is not None and endpoint.healthy, routable))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)
    try:
        rotated = EndpointConfig(url=a.url, api_key="new-token")
        await apply_config(state, state.config.model_copy(update={"endpoints": [rotated]}))
    finally:
        done.set()
        await watcher
    assert seen and all(h and r for h, r in seen), "a 503 window: the endpoint left rotation during reload"
    assert state.registry.get(a.url).healthy
    for _ in range(3):
        assert (await post_chat(http, gw))[0] == 200
    assert a.requests[-1].headers["authorization"] == "Bearer new-token"


# ---- r8: tokens charged up front are refunded on failure ---------------------------------


async def test_failed_requests_refund_their_token_charge(start_upstream, start_gateway, http, tmp_path):
    a = await start_upstream()
    a.mode, a.status = "status", 500
    keys = keys_yaml(tmp_path / "keys.yaml", tokens_per_minute=1000)
    gw = await start_gateway([a.url], auth={"enabled": True, "keys_file": keys})
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    for _ in range(3):  # each charges ~400 tokens up front; three would exceed 1000
        assert (await post_chat(http, gw, headers=auth, max_tokens=400))[0] == 500
    a.mode = "ok"  # recovered; the tenant has used no tokens at all
    assert (await post_chat(http, gw, headers=auth, max_tokens=400))[0] == 200  # old: 429


# ---- r9: a removed endpoint's breaker is not recreated ------------------------------------


async def test_removed_endpoints_breaker_is_not_recreated(stack, start_upstream, start_gateway, http):
    a, c = await start_upstream(), await start_upstream()
    b = await start_own(stack, HeldThen500)
    gw = await start_gateway(
        [a.url, c.url],
        policy="round-robin",
        auth={"admin_key_sha256": ADMIN_SHA},
        health=STICKY_HEALTH,
        resilience={"stall_s": 30, "ejection_s": 30, "check_interval_s": 0.05},
    )
    state = gw.state
    async with http.post(gw.url + "/admin/endpoints", json={"url": b.url}, headers=ADMIN) as resp:
        assert resp.status == 201
    await wait_until(lambda: asyncio.sleep(0, state.registry.get(b.url).healthy), 2.0, "b probed")
    b.mode = "held-500"
    tasks = [asyncio.create_task(post_chat(http, gw)) for _ in range(9)]
    try:
        await wait_until(lambda: asyncio.sleep(0, len(b.requests) >= 3), 2.0, "3 requests held on b")
        async with http.delete(gw.url + "/admin/endpoints", params={"url": b.url}, headers=ADMIN) as resp:
            assert resp.status == 200
            assert (await resp.json())["removed"]["url"] == b.url
        # `_breakers` is private, but "no entry" is the very thing fixed: the public state()
        # answers CLOSED for a missing entry too. Old: the DELETE response's row recreated it.
        assert b.url not in state.breakers._breakers
        b.gate.set()  # the held requests fail (500) after b left the fleet
        assert [r[0] for r in await asyncio.gather(*tasks)] == [200] * 9  # re-sent to a or c
        # Old: those failures were recorded on a recreated breaker, which tripped (OPEN).
        assert b.url not in state.breakers._breakers
    finally:
        b.gate.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    b.mode = "ok"
    async with http.post(gw.url + "/admin/endpoints", json={"url": b.url}, headers=ADMIN) as resp:
        assert resp.status == 201
        assert (await resp.json())["breaker"] == "closed"  # the same address starts afresh
    await wait_until(lambda: asyncio.sleep(0, state.registry.get(b.url).healthy), 2.0, "b probed again")
    served = [(await post_chat(http, gw))[1] for _ in range(3)]
    assert b.name in served  # and is routed to again


# ---- /debug/endpoints with auth on -----------------------------------------------------------


async def test_debug_endpoints_needs_the_admin_key_when_auth_is_on(
    start_upstream, start_gateway, http, tmp_path
):
    a = await start_upstream()
    keys = keys_yaml(tmp_path / "keys.yaml")
    gw = await start_gateway(
        [a.url], auth={"enabled": True, "keys_file": keys, "admin_key_sha256": ADMIN_SHA}
    )
    url = gw.url + "/debug/endpoints"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {TENANT_KEY}"}):
        async with http.get(url, headers=headers) as resp:
            assert resp.status == 401  # old: 200 with the fleet's internals
    async with http.get(url, headers=ADMIN) as resp:
        assert resp.status == 200
        assert [r["url"] for r in (await resp.json())["endpoints"]] == [a.url]

    closed = await start_gateway([a.url], auth={"enabled": True, "keys_file": keys})
    async with http.get(closed.url + "/debug/endpoints", headers=ADMIN) as resp:
        assert resp.status == 404  # no admin key configured: not there at all

    open_gw = await start_gateway([a.url])  # auth off (the demo): unchanged
    async with http.get(open_gw.url + "/debug/endpoints") as resp:
        assert resp.status == 200


# ---- the body's "priority" with auth on ----------------------------------------------------


async def test_clients_body_priority_reaches_the_engine_only_without_auth(
    start_upstream, start_gateway, http, tmp_path
):
    a = await start_upstream()
    keys = keys_yaml(tmp_path / "keys.yaml", priority="standard")
    auth = {"authorization": f"Bearer {TENANT_KEY}"}

    gw = await start_gateway([a.url], auth={"enabled": True, "keys_file": keys})
    assert (await post_chat(http, gw, headers=auth, priority=-100))[0] == 200
    sent = a.requests[-1].json
    assert "priority" not in sent  # old: -100, ahead of every other tenant in the engine
    assert sent["messages"] == chat_body()["messages"] and sent["max_tokens"] == 4

    ranked = await start_gateway(
        [a.url],
        auth={"enabled": True, "keys_file": keys},
        admission={"engine_priority": {"critical": 1, "standard": 5, "sheddable": 9}},
    )
    assert (await post_chat(http, ranked, headers=auth, priority=-100))[0] == 200
    assert a.requests[-1].json["priority"] == 5  # the tenant's class, not what it asked for

    open_gw = await start_gateway([a.url])
    assert (await post_chat(http, open_gw, priority=-100))[0] == 200
    assert a.requests[-1].json["priority"] == -100  # no tenants to protect: passed through


# ---- SIGHUP without --config ---------------------------------------------------------------


async def test_sighup_without_a_config_file_does_not_kill_the_gateway(start_upstream, http, tmp_path):
    a = await start_upstream()
    gw = await start_gateway_process([a.url], log_dir=tmp_path)
    try:
        gw.process.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.5)
        assert gw.process.returncode is None, gw.log_tail()  # old: SIGHUP's default action killed it
        async with http.get(gw.url + "/health") as resp:
            assert resp.status == 200
        assert (await post_chat(http, gw))[0] == 200
    finally:
        await gw.stop()
