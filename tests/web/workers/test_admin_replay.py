"""Admin changes replayed to sibling workers once the admin state is large."""

from __future__ import annotations

import asyncio

from loadtest.harness.ports import free_ports
from tests.support.workers import by_worker, spawn_admin_gateway

KEY = "workers-admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}


async def _rows(session, url: str) -> dict[str, dict]:
    async with session.get(url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return {row["url"]: row for row in (await resp.json())["endpoints"]}


async def test_admin_changes_still_reach_the_sibling_when_the_admin_state_is_large(start_sim, tmp_path):
    sim = await start_sim(model="m")
    gw = await spawn_admin_gateway(sim.url, KEY, tmp_path)
    try:
        async with by_worker(gw.url) as found:
            first, second = (sessions[0] for sessions in found.values())
            # 8 admin endpoints, each with ~150 KB of labels: the whole admin state is ~1.2 MB
            urls = [f"http://127.0.0.1:{p}" for p in free_ports(8)]
            for url in urls:
                labels = {f"k{j}": "v" * 1000 for j in range(150)}
                async with first.post(
                    gw.url + "/admin/endpoints",
                    json={"url": url, "models": ["m"], "labels": labels},
                    headers=ADMIN,
                ) as resp:
                    assert resp.status == 201, await resp.text()
            # a small change after that: drain the config endpoint through the first worker
            async with first.post(
                gw.url + "/admin/endpoints/drain", json={"url": sim.url}, headers=ADMIN
            ) as resp:
                assert resp.status == 200, await resp.text()
            rows: dict[str, dict] = {}
            for _ in range(30):
                rows = await _rows(second, gw.url)
                if rows[sim.url]["draining"] and all(u in rows for u in urls):
                    break
                await asyncio.sleep(0.1)
            missing = [u for u in urls if u not in rows]
            assert not missing, (missing, gw.log_tail(3000))
            assert rows[sim.url]["draining"], gw.log_tail(3000)  # else the second worker keeps routing there
    finally:
        await gw.stop()
