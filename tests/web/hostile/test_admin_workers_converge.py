"""Two admin changes at the same moment through two workers both take effect and the workers
agree: changes are made one at a time across the workers, each on the newest admin state.
Before, each worker applied the other's whole state over its own and the two kept different
fleets until the next admin call (found by review, 2026-12-05)."""

from __future__ import annotations

import asyncio

from loadtest.harness.ports import free_ports
from tests.support.workers import by_worker, spawn_admin_gateway

KEY = "workers-admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}


async def _admin_urls(session, url: str) -> set[str]:
    async with session.get(url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return {row["url"] for row in (await resp.json())["endpoints"] if row["source"] == "admin"}


async def test_concurrent_admin_adds_through_two_workers_converge(start_sim, tmp_path):
    sim = await start_sim(model="m")
    gw = await spawn_admin_gateway(sim.url, KEY, tmp_path)
    try:
        async with by_worker(gw.url) as found:
            first, second = (sessions[0] for sessions in found.values())
            used: set[int] = set()  # nothing listens on these ports: a later draw may repeat one
            for attempt in range(30):  # bounded: each attempt is two adds at the same moment
                ports = [p for p in free_ports(8) if p not in used][:2]
                used.update(ports)
                x, y = (f"http://127.0.0.1:{p}" for p in ports)

                async def add(session, url):
                    async with session.post(
                        gw.url + "/admin/endpoints", json={"url": url, "models": ["m"]}, headers=ADMIN
                    ) as resp:
                        return resp.status, await resp.text()

                answers = await asyncio.gather(add(first, x), add(second, y))
                assert [status for status, _ in answers] == [201, 201], answers
                await asyncio.sleep(0.3)  # datagrams are delivered within milliseconds
                seen_first = await _admin_urls(first, gw.url)
                seen_second = await _admin_urls(second, gw.url)
                assert seen_first == seen_second, (
                    f"attempt {attempt}: added {x} through the first worker and {y} through the second"
                    " (both 201); "
                    f"first worker {sorted(seen_first)}, second worker {sorted(seen_second)}"
                )
    finally:
        await gw.stop()
