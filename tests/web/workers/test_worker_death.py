"""A worker SIGKILLed mid-load: the survivor's requests all succeed and the table is cleared."""

from __future__ import annotations

import asyncio
import os
import signal

from tests.support.workers import by_worker, spawn_gateway

SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}


async def test_survivor_serves_every_request_while_a_sibling_is_killed(start_sim, tmp_path):
    sims = [await start_sim(model="m", time_scale=5.0) for _ in range(2)]
    config = tmp_path / "gw.yaml"
    config.write_text("scrape:\n  enabled: false\n")
    gw = await spawn_gateway(
        [s.url for s in sims], ["--workers", "2", "--policy", "least-load", "--config", str(config)], tmp_path
    )
    try:
        async with by_worker(gw.url, per_worker=4) as found:
            victim, survivor = list(found)

            async def run(session, n):
                statuses = []
                for _ in range(n):
                    async with session.post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                        body = await resp.read()
                        statuses.append((resp.status, b"[DONE]" in body))
                return statuses

            victim_load = [asyncio.create_task(run(s, 5)) for s in found[victim][:4]]
            survivor_load = [asyncio.create_task(run(s, 5)) for s in found[survivor][:4]]
            await asyncio.sleep(0.2)
            os.kill(int(victim), signal.SIGKILL)
            results = await asyncio.gather(*survivor_load)
            await asyncio.gather(*victim_load, return_exceptions=True)
            flat = [r for rs in results for r in rs]
            assert flat == [(200, True)] * 20, flat
            await asyncio.sleep(0.5)
            async with found[survivor][0].get(gw.url + "/debug/endpoints") as resp:
                rows = (await resp.json())["endpoints"]
            assert all(r["in_flight"] == 0 and r["in_flight_tokens"] == 0 for r in rows), rows
    finally:
        await gw.stop()


async def test_workers_do_not_outlive_a_killed_parent(tmp_path):
    """The parent SIGKILLed (OOM killer, kill -9): its workers must not keep serving the port on
    their own — a restarted gateway would share the port (SO_REUSEPORT) with stale orphans."""
    import aiohttp

    from loadtest.harness.processes import wait_ready
    from tests.support.workers import alive, children

    config = tmp_path / "gw.yaml"
    config.write_text("server:\n  drain_s: 0.2\n  shutdown_timeout_s: 1\n")
    gw = await spawn_gateway(
        ["http://127.0.0.1:9"], ["--workers", "2", "--config", str(config)], tmp_path, ready=False
    )
    kids: list[int] = []
    try:
        await wait_ready(gw, "/health", 30)
        await asyncio.sleep(1.0)
        kids = children(gw.pid)
        assert len(kids) >= 2, kids
        os.kill(gw.pid, signal.SIGKILL)
        await gw.process.wait()
        for _ in range(100):  # they drain (0.2 s) and stop, as on a SIGTERM
            if not any(alive(k) for k in kids):
                break
            await asyncio.sleep(0.1)
        serving = None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            try:
                async with http.get(gw.url + "/health") as resp:
                    serving = (resp.status, resp.headers.get("x-gateway-worker"))
            except aiohttp.ClientError:
                pass
        assert serving is None and not any(alive(k) for k in kids), (serving, {k: alive(k) for k in kids})
    finally:
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)
        await gw.stop()
