"""The admin API refuses what it cannot safely build: an ``api_key_file`` (it would send any local file
to a URL the caller picks), and an add that fails changes nothing.

Each test reproduces a reviewer's finding over real sockets."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, EndpointConfig
from gateway.fleet.membership import ADMIN_SOURCE, CONFIG_SOURCE
from gateway.http.reload import apply_config
from tests.support.edge_cases import ADMIN, ADMIN_SHA, STICKY_HEALTH

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
