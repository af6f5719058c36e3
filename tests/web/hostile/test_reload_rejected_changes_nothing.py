"""A reload rejected for an https endpoint's unreadable ``tls_ca_file`` changes nothing: every
endpoint is built before the routing policy is swapped (found by review, 2026-12-05: the new
policy was live while the reload was counted rejected)."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, EndpointConfig
from gateway.http.reload import ConfigReloader, apply_config
from tests.support.harness import gateway_metrics, metric_value


async def test_a_reload_rejected_for_a_tls_ca_file_changes_nothing(start_upstream, start_gateway, tmp_path):
    a = await start_upstream()
    gw = await start_gateway([a.url])
    state = gw.state
    scheduler, config = state.routing.scheduler, state.config
    assert config.policy != "round-robin"
    bad = EndpointConfig(url="https://127.0.0.1:9", tls_ca_file=str(tmp_path / "missing-ca.pem"))
    new = config.model_copy(update={"policy": "round-robin", "endpoints": [*config.endpoints, bad]})
    with pytest.raises(ConfigError, match="tls_ca_file"):
        await apply_config(state, new)
    assert state.config is config
    assert [e.url for e in state.registry] == [a.url]
    assert state.routing.scheduler is scheduler, "the rejected reload's policy is already routing"


async def test_the_same_through_the_config_file(start_upstream, start_gateway, http, tmp_path):
    a = await start_upstream()
    gw = await start_gateway([a.url], policy="least-load")
    state = gw.state
    scheduler = state.routing.scheduler
    path = tmp_path / "gw.yaml"
    path.write_text(
        "policy: round-robin\n"
        f"endpoints:\n  - url: {a.url}\n"
        f"  - {{url: 'https://127.0.0.1:9', tls_ca_file: '{tmp_path / 'missing-ca.pem'}'}}\n"
        "health: {interval_s: 0.5, timeout_s: 2.0}\nscrape: {interval_s: 0.5, timeout_s: 0.5}\n"
    )
    reloader = ConfigReloader(state, path)
    assert await reloader.reload() == "rejected"
    assert (
        metric_value(await gateway_metrics(http, gw), "llm_gateway_config_reloads_total", result="rejected")
        == 1
    )
    assert state.config.policy == "least-load"
    assert state.routing.scheduler is scheduler, "rejected, yet the round-robin scheduler now routes"
