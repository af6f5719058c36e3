"""Config files small but hostile in shape: nested thousands deep (a rejection, counted and
logged, on SIGHUP: the reload task died silently), and YAML alias bombs (a rejection of
bounded size: a 490-byte file gave a 72 MB log line). Found by review, 2026-12-05."""

from __future__ import annotations

import asyncio
import logging
import signal

import yaml

from gateway.http.reload import ConfigReloader
from loadtest.fleet import start_gateway
from tests.support.harness import metric_value, wait_until


async def _rejected(http, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return metric_value(text, "llm_gateway_config_reloads_total", result="rejected") or 0.0


async def test_a_deeply_nested_config_is_rejected_and_counted_on_sighup(start_sim, http, tmp_path):
    sim = await start_sim(model="m")
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"endpoints": [{"url": sim.url}]}))
    gw = await start_gateway([], ["--config", str(path)], log_dir=tmp_path)
    try:
        path.write_text("endpoints: " + "[" * 5000 + "]" * 5000 + "\n")  # 10 KB
        gw.process.send_signal(signal.SIGHUP)
        try:
            await wait_until(lambda: _has_rejection(http, gw.url), 3.0, "the rejection to be counted")
        except AssertionError:
            raise AssertionError(
                "deeply nested config: reload not counted as rejected; log:\n" + gw.log_tail(600)
            ) from None
        assert "config reload: rejected" in gw.log_tail(20000)
    finally:
        await gw.stop()


async def _has_rejection(http, url: str) -> bool:
    return await _rejected(http, url) >= 1


def _alias_bomb(levels: int) -> str:
    node = "&a0 [" + ",".join(["lol"] * 10) + "]"
    for i in range(1, levels):
        node = f"&a{i} [" + node + "," + ",".join([f"*a{i - 1}"] * 9) + "]"
    return node


async def test_an_alias_bomb_in_a_reload_gives_a_bounded_rejection(
    start_upstream, start_gateway, tmp_path, caplog
):
    a = await start_upstream()
    gw = await start_gateway([a.url])
    path = tmp_path / "gw.yaml"
    text = (
        f"endpoints: [{{url: '{a.url}'}}]\n"
        "plugins:\n"
        f"  - {{type: in-flight, parameters: {{by: {_alias_bomb(7)}}}}}\n"
        "  - {type: max-score}\n"
        "profiles: [{name: default, plugins: [{ref: in-flight}, {ref: max-score}]}]\n"
    )
    path.write_text(text)
    assert len(text) < 1024
    reloader = ConfigReloader(gw.state, path)
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.ERROR, logger="gateway.http.reload"):
        started = loop.time()
        assert await reloader.reload() == "rejected"
        took = loop.time() - started
    longest = max(len(r.getMessage()) for r in caplog.records if r.name == "gateway.http.reload")
    assert longest < 100_000, f"a {len(text)}-byte file gave a {longest:,}-character log line in {took:.2f} s"
