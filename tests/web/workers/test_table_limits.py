"""The shared worker table at its limit (server.worker_table_rows)."""

from __future__ import annotations

import asyncio
import hashlib

from prometheus_client.parser import text_string_to_metric_families

from tests.support.workers import by_worker, spawn_gateway

KEY = "workers-admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}
SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _samples(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels.get("worker", "")] = sample.value
    return out


async def test_table_full_counter_counts_endpoints_not_registry_rebuilds(start_sim, tmp_path):
    """Docs: an endpoint beyond the table 'is logged once and counted'. One endpoint left out,
    two workers: at most one count per worker, however often the fleet is rebuilt."""
    sims = [await start_sim(model="m") for _ in range(2)]
    config = tmp_path / "gw.yaml"
    config.write_text(
        "server:\n  worker_table_rows: 1\n"
        f"auth:\n  admin_key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}\n"
    )
    gw = await spawn_gateway([s.url for s in sims], ["--workers", "2", "--config", str(config)], tmp_path)
    try:
        async with by_worker(gw.url) as found:
            first = next(iter(found.values()))[0]
            for _ in range(
                10
            ):  # ten drain/undrain cycles of the shared endpoint: fleet rebuilds, no new endpoint
                for action in ("drain", "undrain"):
                    async with first.post(
                        gw.url + f"/admin/endpoints/{action}", json={"url": sims[0].url}, headers=ADMIN
                    ) as resp:
                        assert resp.status == 200, await resp.text()
                    await asyncio.sleep(0.1)  # past the idle refresh (50 ms): each rebuild is seen
            await asyncio.sleep(0.5)
            async with first.get(gw.url + "/metrics") as resp:
                text = await resp.text()
        full = _samples(text, "llm_gateway_worker_table_full_total")
        assert len(full) == 2, full
        assert all(v <= 1 for v in full.values()), full
    finally:
        await gw.stop()


def _hold(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hold"}],
        "max_tokens": 3000,
        "stream": True,
    }


async def _in_flight(session, url: str) -> dict[str, int]:
    async with session.get(url + "/debug/endpoints") as resp:
        return {row["url"]: row["in_flight"] for row in (await resp.json())["endpoints"]}


async def _session_on(url: str, pid: str):
    import aiohttp

    for _ in range(300):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with session.get(url + "/health") as resp:
            if resp.headers["x-gateway-worker"] == pid:
                return session
        await session.close()
    raise AssertionError(f"no connection reached worker {pid}")


async def test_a_row_freed_by_a_removed_endpoint_is_used_by_every_worker(start_sim, tmp_path):
    """rows: 1, endpoints a and b: a has the row, b is counted per worker. a is removed (SIGHUP
    reload), which frees the row. Then b must be shared: a stream on b through one worker is
    counted by the other one too (docs: 'counts it until a row frees')."""
    import os
    import signal

    sim_a = await start_sim(model="a", time_scale=1.0)
    sim_b = await start_sim(model="b", time_scale=1.0)
    config = tmp_path / "gw.yaml"
    head = "server:\n  worker_table_rows: 1\nscrape:\n  enabled: false\n"
    config.write_text(
        head + f"endpoints:\n  - url: {sim_a.url}\n    models: [a]\n  - url: {sim_b.url}\n    models: [b]\n"
    )
    gw = await spawn_gateway([], ["--workers", "2", "--config", str(config)], tmp_path)
    opened = []
    try:
        async with by_worker(gw.url) as found:
            config.write_text(head + f"endpoints:\n  - url: {sim_b.url}\n    models: [b]\n")
            os.kill(gw.pid, signal.SIGHUP)
            sessions = {pid: sessions[0] for pid, sessions in found.items()}
            for _ in range(50):
                views = [await _in_flight(s, gw.url) for s in sessions.values()]
                if all(sim_a.url not in v for v in views):
                    break
                await asyncio.sleep(0.1)
            assert all(sim_a.url not in v for v in views), views
            await asyncio.sleep(1.0)  # far past the 50 ms idle refresh
            seen = {}
            for pid in sessions:  # a stream through each worker in turn; the other one must count it
                opened.append(holder := await _session_on(gw.url, pid))
                stream = await holder.post(gw.url + "/v1/chat/completions", json=_hold("b"))
                assert stream.status == 200 and stream.headers["x-gateway-worker"] == pid
                await asyncio.sleep(0.3)
                seen[pid] = {p: (await _in_flight(s, gw.url))[sim_b.url] for p, s in sessions.items()}
                stream.close()
                await asyncio.sleep(0.3)
            assert all(v == 1 for view in seen.values() for v in view.values()), seen
    finally:
        for session in opened:
            await session.close()
        await gw.stop()
