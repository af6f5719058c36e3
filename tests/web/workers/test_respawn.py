"""A worker that dies is started again: with the config as reloaded and the admin changes it
missed, counted in /metrics; one that keeps dying is started ever slower."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.http.server import _RESPAWN_DELAYS_S, _RESPAWN_WINDOW_S, _Respawns
from tests.support.workers import by_worker, children, spawn_gateway, worker_pids

KEY = "respawn-admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _config(urls: list[str]) -> str:
    endpoints = "".join(f"  - url: {url}\n    models: [m]\n" for url in urls)
    return (
        f"auth:\n  admin_key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}\n"
        "server:\n  drain_s: 0.2\n  shutdown_timeout_s: 1\n"
        f"scrape:\n  enabled: false\nendpoints:\n{endpoints}"
    )


async def _new_worker(gw, old: set[int]) -> int:
    """The pid of the worker started in place of a dead one."""
    for _ in range(300):
        kids = worker_pids(gw.pid)
        fresh = kids - old
        if len(kids) == 2 and fresh:
            return fresh.pop()
        await asyncio.sleep(0.05)
    raise AssertionError(f"no worker started again: children {children(gw.pid)}\n{gw.log_tail(3000)}")


@contextlib.asynccontextmanager
async def _session_on(url: str, pid: int) -> AsyncIterator[aiohttp.ClientSession]:
    """A one-connection client session that the worker ``pid`` serves."""
    for _ in range(400):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        try:
            async with session.get(url + "/ready") as resp:
                if resp.status == 200 and resp.headers["x-gateway-worker"] == str(pid):
                    break
        except aiohttp.ClientError:
            pass
        await session.close()
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"no connection reached worker {pid}")
    try:
        yield session
    finally:
        await session.close()


async def _admin_rows(session: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    async with session.get(url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return {row["url"]: row for row in (await resp.json())["endpoints"]}


async def test_a_killed_worker_is_started_again_with_the_reloaded_config_and_the_admin_changes(
    start_sim, tmp_path
):
    sims = [await start_sim(model="m") for _ in range(3)]
    config = tmp_path / "gw.yaml"
    config.write_text(_config([sims[0].url]))
    gw = await spawn_gateway([], ["--workers", "2", "--config", str(config)], tmp_path)
    try:
        async with by_worker(gw.url) as found:
            first, second = (sessions[0] for sessions in found.values())
            # a reload (the file gains an endpoint), then admin changes through the first worker
            config.write_text(_config([sims[0].url, sims[1].url]))
            os.kill(gw.pid, signal.SIGHUP)
            for _ in range(100):
                if sims[1].url in await _admin_rows(second, gw.url):
                    break
                await asyncio.sleep(0.05)
            async with first.post(
                gw.url + "/admin/endpoints", json={"url": sims[2].url, "models": ["m"]}, headers=ADMIN
            ) as resp:
                assert resp.status == 201, await resp.text()
            async with first.post(
                gw.url + "/admin/endpoints/drain", json={"url": sims[0].url}, headers=ADMIN
            ) as resp:
                assert resp.status == 200, await resp.text()
            before = await _admin_rows(first, gw.url)
            victim = next(pid for pid, sessions in found.items() if sessions[0] is second)
        old = worker_pids(gw.pid)
        os.kill(int(victim), signal.SIGKILL)
        fresh = await _new_worker(gw, old)
        async with _session_on(gw.url, fresh) as session:
            after = await _admin_rows(session, gw.url)
            assert set(after) == set(before) == {s.url for s in sims}, (after, gw.log_tail(3000))
            assert [u for u, row in after.items() if row["draining"]] == [sims[0].url], after
            for _ in range(10):  # it serves, and never on the drained replica
                async with session.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-gateway-endpoint"] != sims[0].url.split("://", 1)[1]
            async with session.get(gw.url + "/metrics") as resp:
                text = await resp.text()
        respawns = {
            line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("llm_gateway_worker_respawns_total{")
        }
        assert sorted(respawns.values()) == [0.0, 1.0], respawns
        assert "worker 1" in gw.log_tail(5000) or "worker 0" in gw.log_tail(5000)
    finally:
        code = await gw.stop()
    assert code == 0, gw.log_tail(3000)  # a death recovered from is not a failed stop


async def test_a_killed_worker_and_its_replacement_killed_as_it_starts_are_both_replaced(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(2)]
    config = tmp_path / "gw.yaml"
    config.write_text(_config([s.url for s in sims]))
    gw = await spawn_gateway([], ["--workers", "2", "--config", str(config)], tmp_path)
    try:
        async with by_worker(gw.url):  # both listen
            old = worker_pids(gw.pid)
        victim = min(old)
        os.kill(victim, signal.SIGKILL)
        replacement = await _new_worker(gw, old)
        os.kill(replacement, signal.SIGKILL)  # at once: it is still importing, not yet listening
        old = worker_pids(gw.pid) | {replacement}
        fresh = await _new_worker(gw, old)  # its second death in a minute: started after 0.5 s
        workers = worker_pids(gw.pid)
        assert fresh in workers and not {victim, replacement} & workers, (workers, gw.log_tail(3000))
        async with _session_on(gw.url, fresh):  # it listens (SO_REUSEPORT has its socket again)
            pass
        # every new connection is served, spread over both workers again
        served: dict[str, int] = {}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            for _ in range(60):
                async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200, await resp.text()
                    worker = resp.headers["x-gateway-worker"]
                    served[worker] = served.get(worker, 0) + 1
        assert set(served) == {str(p) for p in workers}, (served, workers)
        assert "starting it again in 0.5 s" in gw.log_tail(5000), gw.log_tail(3000)
    finally:
        await gw.stop()


@pytest.mark.parametrize("gap_s", [0.0, 1.0])
def test_a_worker_that_keeps_dying_is_started_ever_slower(gap_s):
    respawns = _Respawns()
    delays = [respawns.delay_after_exit(0, 100.0 + i * gap_s) for i in range(len(_RESPAWN_DELAYS_S) + 3)]
    assert delays == [*_RESPAWN_DELAYS_S, *[_RESPAWN_DELAYS_S[-1]] * 3]
    assert respawns.delay_after_exit(1, 100.0) == 0.0  # another slot has its own count
    # a minute without dying: the next death is started at once again
    assert respawns.delay_after_exit(0, 200.0 + _RESPAWN_WINDOW_S) == 0.0
