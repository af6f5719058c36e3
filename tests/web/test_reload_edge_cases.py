"""Config reload at its edges: a broken keys file rejects the whole reload; rotating only an endpoint's
api_key keeps it routable; SIGHUP without a config file.

Each test reproduces a reviewer's finding over real sockets."""

from __future__ import annotations

import asyncio
import signal

import pytest

from gateway.config import ConfigError, EndpointConfig
from gateway.fleet.membership import CONFIG_SOURCE
from gateway.http.reload import apply_config
from loadtest.fleet import start_gateway as start_gateway_process
from tests.support.edge_cases import TENANT_KEY, keys_yaml, post_chat
from tests.support.harness import wait_until

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
