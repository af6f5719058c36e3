"""A config reload (SIGHUP to the parent) while two workers serve conversations.

Every request answers 200 (none lost, none failed) while the fleet grows by one replica and
shrinks back and the retry settings change, both workers apply every reload, and afterwards
the workers still agree on every conversation's replica (the session pins they broadcast
survive the reloads: a reload keeps the session store and its broadcast).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.workers import by_worker, handles_signal, spawn_gateway

HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


def _config(urls: list[str], retries: int) -> str:
    return json.dumps({"endpoints": [{"url": u} for u in urls], "limits": {"retries": retries}})


async def _conversation(
    gw_url: str, session: str | None, stop: asyncio.Event, served: list[str], failures: list[str]
) -> None:
    """Turns on fresh connections until ``stop`` (bounded: at most 2,000)."""
    headers = {"x-session-id": session} if session else {}
    for _ in range(2000):
        if stop.is_set():
            return
        connector = aiohttp.TCPConnector(force_close=True)  # fresh connections: both workers
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            async with http.post(gw_url + "/v1/chat/completions", json=HI, headers=headers) as resp:
                text = await resp.text()
                if resp.status != 200 or not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
                    failures.append(f"{resp.status}: {text[-300:]}")
                    continue
                served.append(resp.headers["x-gateway-endpoint"])


def _applied(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "llm_gateway_config_reloads_total" and sample.labels.get("result") == "applied":
                out[sample.labels.get("worker", "")] = sample.value
    return out


async def test_reloads_under_load_lose_nothing_and_workers_still_agree_on_sessions(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(4)]
    base, extra = [s.url for s in sims[:3]], sims[3].url
    config = tmp_path / "gw.yaml"
    config.write_text(_config(base, 1))
    gw = await spawn_gateway(
        [], ["--workers", "2", "--policy", "session-aware", "--config", str(config)], tmp_path
    )
    try:
        for _ in range(200):
            if handles_signal(gw.pid, signal.SIGHUP):
                break
            await asyncio.sleep(0.02)
        served: dict[str, list[str]] = {f"c{i}": [] for i in range(6)}
        failures: list[str] = []
        anonymous: list[str] = []  # requests without a session: placed by load, so some reach `extra`
        stop = asyncio.Event()
        load = [asyncio.create_task(_conversation(gw.url, s, stop, served[s], failures)) for s in served]
        load += [asyncio.create_task(_conversation(gw.url, None, stop, anonymous, failures)) for _ in "ab"]
        for urls, retries in ((base, 2), ([*base, extra], 2), ([*base, extra], 1), (base, 1)):
            await asyncio.sleep(0.4)
            config.write_text(_config(urls, retries))
            os.kill(gw.pid, signal.SIGHUP)  # the parent forwards it to every worker
        await asyncio.sleep(0.4)
        stop.set()
        await asyncio.gather(*load)
        assert not failures, failures[:5]
        assert all(len(turns) > 20 for turns in served.values()), {s: len(t) for s, t in served.items()}
        joined = extra.removeprefix("http://")
        assert joined in anonymous, sorted(set(anonymous))  # the fleet changed under load

        async with by_worker(gw.url) as by_pid:
            (a, *_), (b, *_) = by_pid.values()
            for _ in range(100):  # every worker applied all four reloads
                async with a.get(gw.url + "/metrics") as resp:
                    applied = _applied(await resp.text())
                if len(applied) == 2 and all(v >= 4 for v in applied.values()):
                    break
                await asyncio.sleep(0.05)
            assert len(applied) == 2 and all(v >= 4 for v in applied.values()), (applied, gw.log_tail(3000))
            for session in served:  # quiet now: both workers send each conversation to one replica
                endpoints = []
                for http in (a, b, a, b):
                    async with http.post(
                        gw.url + "/v1/chat/completions", json=HI, headers={"x-session-id": session}
                    ) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                        endpoints.append(resp.headers["x-gateway-endpoint"])
                assert len(set(endpoints)) == 1, (session, endpoints)
                assert endpoints[0] != extra.removeprefix("http://")  # the removed replica is gone
    finally:
        await gw.stop()
