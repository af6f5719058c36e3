"""A real ``llm-gateway serve`` process: graceful SIGTERM, and config hot reload (SIGHUP and file watch)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import yaml

from loadtest.fleet import start_gateway
from tests.support.harness import metric_value, wait_until


async def _stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[int, str]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, (await resp.read()).decode()


async def test_sigterm_drains_then_finishes_streams_then_exits(start_sim, http, tmp_path):
    sim = await start_sim(model="m", time_scale=1.0, decode_step_ms=10.0)  # ~10 ms per token, real time
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump({"server": {"drain_s": 0.5, "shutdown_timeout_s": 10}}))
    gw = await start_gateway([sim.url], ["--config", str(config)], log_dir=tmp_path)
    try:
        streams = [asyncio.create_task(_stream(http, gw.url, 150)) for _ in range(3)]  # ≈1.5 s each
        await asyncio.sleep(0.3)
        gw.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.15)
        async with http.get(gw.url + "/ready") as resp:  # still listening during the drain, not ready
            assert resp.status == 503
            assert (await resp.json())["shutting_down"] is True
        results = await asyncio.gather(*streams)
        for status, text in results:
            assert status == 200
            assert text.endswith("data: [DONE]\n\n")
            assert '"finish_reason":"length"' in text.replace(" ", "")  # every token arrived
            assert "error" not in text
        assert await asyncio.wait_for(gw.process.wait(), 5) == 0
        try:
            async with http.get(gw.url + "/health") as resp:
                raise AssertionError(f"still serving after exit: {resp.status}")
        except aiohttp.ClientConnectionError:
            pass
    finally:
        await gw.stop()


async def test_reload_applies_a_valid_config_and_keeps_the_old_one_on_error(start_sim, http, tmp_path):
    first = await start_sim(model="m")
    second = await start_sim(model="m")
    path = tmp_path / "gw.yaml"
    base = {"endpoints": [{"url": first.url}], "policy": "round-robin", "health": {"interval_s": 0.2}}
    path.write_text(yaml.safe_dump(base))
    gw = await start_gateway([], ["--config", str(path)], log_dir=tmp_path)
    try:
        # A long stream on the first endpoint survives that endpoint's removal by reload.
        stream = asyncio.create_task(_stream(http, gw.url, 400))
        await asyncio.sleep(0.2)

        _write(path, {**base, "endpoints": [{"url": second.url}]})
        gw.process.send_signal(signal.SIGHUP)
        await wait_until(lambda: _served_by(http, gw.url, second.url), 3.0, "the reloaded endpoint to serve")
        assert await _reloads(http, gw.url, "applied") == 1
        status, text = await stream
        assert status == 200 and text.endswith("data: [DONE]\n\n") and "error" not in text

        # Invalid: unknown policy. Rejected, counted, and the running config keeps serving.
        _write(path, {**base, "endpoints": [{"url": first.url}], "policy": "no-such-policy"})
        gw.process.send_signal(signal.SIGHUP)
        await wait_until(lambda: _has_reloads(http, gw.url, "rejected"), 3.0, "the rejection to be counted")
        for _ in range(3):
            assert await _served_by(http, gw.url, second.url)

        # The file watch picks up a change without any signal (poll every 2 s).
        _write(path, {**base, "endpoints": [{"url": first.url}, {"url": second.url}]})
        await wait_until(lambda: _reloads_at_least(http, gw.url, "applied", 2), 5.0, "the file watch")
        await wait_until(lambda: _served_by(http, gw.url, first.url), 2.0, "both endpoints to serve")
        assert "no-such-policy" in gw.log_tail(20000)  # the rejection was logged with its reason
    finally:
        await gw.stop()


def _write(path: Path, config: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config))
    tmp.replace(path)  # atomic, like a ConfigMap update


async def _served_by(http: aiohttp.ClientSession, gateway: str, upstream: str) -> bool:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(gateway + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-gateway-endpoint"] == upstream.split("://", 1)[1]


async def _reloads(http: aiohttp.ClientSession, gateway: str, result: str) -> float:
    async with http.get(gateway + "/metrics") as resp:
        text = await resp.text()
    return metric_value(text, "llm_gateway_config_reloads_total", result=result) or 0.0


async def _has_reloads(http, gateway, result) -> bool:
    return await _reloads(http, gateway, result) >= 1


async def _reloads_at_least(http, gateway, result, count) -> bool:
    return await _reloads(http, gateway, result) >= count


async def test_keys_file_changes_are_picked_up_without_a_signal(start_sim, http, tmp_path):
    from gateway.auth import hash_key

    sim = await start_sim(model="m")
    keys = tmp_path / "keys.yaml"
    tenants = {"t": {"requests_per_minute": 0}}
    _write(keys, {"tenants": tenants, "keys": [{"sha256": hash_key("sk-old"), "tenant": "t"}]})
    path = tmp_path / "gw.yaml"
    _write(path, {"endpoints": [{"url": sim.url}], "auth": {"enabled": True, "keys_file": str(keys)}})
    gw = await start_gateway([], ["--config", str(path)], log_dir=tmp_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def status(key: str) -> int:
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-api-key": key}) as resp:
            return resp.status

    try:
        assert await status("sk-old") == 200 and await status("sk-new") == 401
        _write(keys, {"tenants": tenants, "keys": [{"sha256": hash_key("sk-new"), "tenant": "t"}]})
        await wait_until(lambda: _is(status("sk-new"), 200), 5.0, "the new key to be accepted")
        assert await status("sk-old") == 401  # rotated out
        keys.write_text("keys: [broken")  # a bad edit keeps the keys in force
        await asyncio.sleep(2.5)
        assert await status("sk-new") == 200
    finally:
        await gw.stop()


async def _is(awaitable, expected) -> bool:
    return await awaitable == expected


async def test_a_stop_does_not_wait_for_a_reload_probing_a_silent_replica(start_sim, tmp_path):
    """A reload adds a replica that accepts connections and never answers, with a 20 s health
    timeout; a stop then comes. The reload is abandoned, not waited for: the stop takes its
    drain and shutdown budget, not the probe's 20 s."""
    sim = await start_sim(model="m")
    silent = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)  # accepts, never answers
    silent_url = f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"

    def config(urls: list[str]) -> str:
        return yaml.safe_dump({
            "server": {"drain_s": 0.2, "shutdown_timeout_s": 1},
            "health": {"timeout_s": 20},
            "endpoints": [{"url": u, "models": ["m"]} for u in urls],
        })  # fmt: skip

    path = tmp_path / "gw.yaml"
    path.write_text(config([sim.url]))
    gw = await start_gateway([], ["--config", str(path)], log_dir=tmp_path)
    try:
        path.write_text(config([sim.url, silent_url]))
        gw.process.send_signal(signal.SIGHUP)
        await asyncio.sleep(1.0)  # the reload is probing the silent replica
        began = asyncio.get_running_loop().time()
        gw.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(gw.process.wait(), 15) == 0, gw.log_tail(3000)
        assert asyncio.get_running_loop().time() - began < 5.0, gw.log_tail(3000)
    finally:
        await gw.stop()
        silent.close()
