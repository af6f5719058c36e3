"""A replacement worker that leaves out an admin endpoint it cannot build does not erase it
from its siblings: its next admin change (a drain of another endpoint) keeps the endpoint in
the state it sends. Found by the final review (2026-12-05): the sibling removed it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest

from tests.support.workers import by_worker, spawn_admin_gateway, worker_pids
from tests.web.hostile.test_admin_catch_up_skips_unbuildable import (
    ADMIN,
    KEY,
    TLS_URL,
    add_unbuildable_admin_endpoint,
)


async def _admin_urls(session, url: str) -> set[str]:
    async with session.get(url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return {row["url"] for row in (await resp.json())["endpoints"] if row["source"] == "admin"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test CA")
async def test_a_drain_through_the_replacement_keeps_the_siblings_admin_endpoint(start_sim, tmp_path):
    sim = await start_sim(model="m")
    gw = await spawn_admin_gateway(sim.url, KEY, tmp_path)
    try:
        await add_unbuildable_admin_endpoint(gw, tmp_path)

        before = worker_pids(gw.process.pid)
        victim = sorted(before)[0]
        survivor = next(p for p in before if p != victim)
        os.kill(victim, signal.SIGKILL)
        for _ in range(100):  # bounded: up to 10 s for the replacement
            await asyncio.sleep(0.1)
            if len(worker_pids(gw.process.pid) - {victim}) == 2:
                break
        await asyncio.sleep(1.0)
        async with by_worker(gw.url) as found:
            assert str(survivor) in found, f"workers seen: {list(found)}"
            replacement = next(s for pid, s in found.items() if pid != str(survivor))[0]
            kept = found[str(survivor)][0]
            assert TLS_URL in await _admin_urls(kept, gw.url)
            async with replacement.post(
                gw.url + "/admin/endpoints/drain", json={"url": sim.url}, headers=ADMIN
            ) as resp:
                assert resp.status == 200, await resp.text()
            await asyncio.sleep(0.3)
            left = await _admin_urls(kept, gw.url)
            assert TLS_URL in left, (
                f"a drain through the replacement worker removed {TLS_URL} from its sibling: {left}"
            )
    finally:
        await gw.stop()
