"""A worker started again applies the admin state it finds, leaving out an endpoint it can no
longer build (its ``tls_ca_file`` moved since the admin API added it), instead of dying at
start-up and crash-looping while its sibling serves (found by review, 2026-12-05)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest

from tests.fleet.servers import self_signed
from tests.support.harness import metric_value
from tests.support.workers import alive, by_worker, spawn_admin_gateway, worker_pids

KEY = "workers-admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}


TLS_URL = "https://127.0.0.1:9"


async def add_unbuildable_admin_endpoint(gw, tmp_path) -> None:
    """An https admin endpoint whose CA file is then removed: the running workers keep the
    endpoint they built; a worker started after this cannot build it."""
    cert, _key = self_signed(tmp_path, "admin-ca")
    async with by_worker(gw.url) as found:
        session = next(iter(found.values()))[0]
        body = {"url": TLS_URL, "models": ["m"], "tls_ca_file": str(cert)}
        async with session.post(gw.url + "/admin/endpoints", json=body, headers=ADMIN) as resp:
            assert resp.status == 201, await resp.text()
    await asyncio.sleep(0.3)
    cert.unlink()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test CA")
async def test_a_replacement_worker_starts_despite_an_unbuildable_admin_endpoint(start_sim, http, tmp_path):
    sim = await start_sim(model="m")
    gw = await spawn_admin_gateway(sim.url, KEY, tmp_path)
    try:
        await add_unbuildable_admin_endpoint(gw, tmp_path)
        victim = sorted(worker_pids(gw.process.pid))[0]
        os.kill(victim, signal.SIGKILL)
        for _ in range(100):  # bounded: up to 10 s for the replacement to listen
            await asyncio.sleep(0.1)
            pids = worker_pids(gw.process.pid) - {victim}
            async with http.get(gw.url + "/metrics") as resp:
                text = await resp.text()
            listening = metric_value(text, "llm_gateway_workers_listening")
            if (
                listening is not None
                and max_of(text, "llm_gateway_workers_listening") == 2
                and len(pids) == 2
            ):
                break
        else:
            raise AssertionError("the replacement worker never listened; log:\n" + gw.log_tail(2500))
        assert all(alive(p) for p in pids)
    finally:
        await gw.stop()


def max_of(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return max(values) if values else 0.0
