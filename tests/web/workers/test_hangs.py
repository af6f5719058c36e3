"""A worker that is alive but no longer runs its event loop (here: SIGSTOP, which a blocked loop
looks like from outside) is killed after ``server.worker_timeout_s`` and started again; healthy
workers, idle or busy, are left alone; a stop does not wait for a hung worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.workers import alive, by_worker, shared_directory, spawn_gateway, worker_pids
from tests.web.workers.test_respawn import CHAT, _new_worker, _worker_metrics


async def _gateway(tmp_path, url: str, timeout_s: float, new_session: bool = False):
    config = tmp_path / "gw.yaml"
    config.write_text(
        f"server:\n  drain_s: 0.2\n  shutdown_timeout_s: 1\n  worker_timeout_s: {timeout_s}\n"
        f"scrape:\n  enabled: false\nendpoints:\n  - url: {url}\n    models: [m]\n"
    )
    args = ["--workers", "2", "--config", str(config)]
    return await spawn_gateway([], args, tmp_path, new_session=new_session)


async def _hangs(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llm_gateway_worker_hangs_total{"):
            slot = line.split('slot="', 1)[1].split('"', 1)[0]
            found[slot] = max(found.get(slot, 0.0), float(line.rsplit(" ", 1)[1]))
    return found


@contextlib.asynccontextmanager
async def _one_worker_stopped(
    start_sim, tmp_path, timeout_s: float
) -> AsyncIterator[tuple[Any, set[int], int]]:
    """``serve --workers 2``, both listening, then one SIGSTOPped: (gateway, workers, stopped pid).
    On the way out the stopped one is let go (SIGCONT) and the gateway stopped if still running."""
    sim = await start_sim(model="m")
    gw = await _gateway(tmp_path, sim.url, timeout_s)
    victim = 0
    try:
        async with by_worker(gw.url):
            old = worker_pids(gw.pid)
        victim = min(old)
        os.kill(victim, signal.SIGSTOP)
        yield gw, old, victim
    finally:
        if victim and alive(victim):
            os.kill(victim, signal.SIGCONT)
        await gw.stop()


async def test_a_stopped_worker_is_killed_and_started_again_and_healthy_ones_are_left_alone(
    start_sim, tmp_path
):
    sim = await start_sim(model="m")
    gw = await _gateway(tmp_path, sim.url, timeout_s=1)
    try:
        async with by_worker(gw.url) as found:
            old = worker_pids(gw.pid)
            # three timeouts of idle time and traffic: both workers beat, nobody is killed
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                for sessions in found.values():
                    async with sessions[0].post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                        assert resp.status == 200, await resp.text()
                await asyncio.sleep(0.2)
        assert worker_pids(gw.pid) == old, gw.log_tail(3000)
        assert await _hangs(gw.url) == {"0": 0.0, "1": 0.0}
        victim = min(old)
        directory = Path(shared_directory(victim))
        left = [directory / f"responses-catch-up-9-to-{slot}-1" for slot in (0, 1)]  # answers nobody reads
        for path in left:
            path.write_bytes(b"[]")
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        fresh = await _new_worker(gw, old)
        waited = time.monotonic() - stopped_at
        # the timeout runs from its last beat, at most a beat (timeout / 4) before the SIGSTOP
        assert 0.75 <= waited < 5.0, waited
        assert not alive(victim)
        async with by_worker(gw.url) as found:  # both slots serve again
            assert set(found) == {str(fresh), str(max(old))}, (set(found), fresh, old)
            for sessions in found.values():
                async with sessions[0].post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200, await resp.text()
        hangs = await _hangs(gw.url)
        assert sorted(hangs.values()) == [0.0, 1.0], hangs
        dead_slot = int(next(slot for slot, n in hangs.items() if n == 1))
        assert [path.exists() for path in left] == [dead_slot != 0, dead_slot != 1]  # the dead one's went
        counts = await _worker_metrics(gw.url)
        assert counts["listening"] == 2 and sorted([counts["slot 0"], counts["slot 1"]]) == [0.0, 1.0]
        assert "its event loop has not run for" in gw.log_tail(5000)
    finally:
        code = await gw.stop()
    assert code == 0, gw.log_tail(3000)  # a hang recovered from is not a failed stop


async def test_a_stop_does_not_wait_for_a_stopped_worker(start_sim, tmp_path):
    async with _one_worker_stopped(start_sim, tmp_path, timeout_s=1) as (gw, _, victim):
        gw.process.terminate()
        # the other worker drains (0.2 s) and exits; the stopped one would never have
        code = await asyncio.wait_for(gw.process.wait(), 10)
        assert code == 1, gw.log_tail(3000)  # a worker had to be killed: not a clean stop
        assert not alive(victim)
        assert "its event loop has not run for" in gw.log_tail(5000)


async def test_no_worker_is_killed_when_the_timeout_is_zero(start_sim, tmp_path):
    async with _one_worker_stopped(start_sim, tmp_path, timeout_s=0) as (gw, old, victim):
        await asyncio.sleep(2.5)
        assert worker_pids(gw.pid) == old and alive(victim)
        os.kill(victim, signal.SIGCONT)
        async with by_worker(gw.url) as found:
            assert set(found) == {str(p) for p in old}
        assert await gw.stop() == 0, gw.log_tail(3000)


async def test_a_pause_of_the_whole_gateway_kills_no_worker(start_sim, tmp_path):
    """Ctrl-Z, `docker pause`, a frozen cgroup: the parent stops with its workers, and on resume
    their silence is not theirs (it killed every worker as hung)."""
    sim = await start_sim(model="m")
    gw = await _gateway(tmp_path, sim.url, timeout_s=1, new_session=True)  # its own process group
    try:
        async with by_worker(gw.url):
            old = worker_pids(gw.pid)
        os.killpg(gw.pid, signal.SIGSTOP)
        await asyncio.sleep(3)
        os.killpg(gw.pid, signal.SIGCONT)
        await asyncio.sleep(2)  # two timeouts after the resume
        assert worker_pids(gw.pid) == old, gw.log_tail(3000)
        assert await _hangs(gw.url) == {"0": 0.0, "1": 0.0}
        async with by_worker(gw.url) as found:
            assert set(found) == {str(p) for p in old}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gw.pid, signal.SIGCONT)
        code = await gw.stop()
    assert code == 0, gw.log_tail(3000)
