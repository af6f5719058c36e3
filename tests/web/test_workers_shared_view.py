"""``--workers 2`` sharing one fleet view: load counted in one worker steers the other.

A real ``llm-gateway serve --workers 2`` in front of real simulators. The kernel spreads
*connections* over the workers (SO_REUSEPORT), and every response names its worker
(``x-gateway-worker``), so the tests open connections until they hold some on each worker.
Scraping is off: the engines' own counts would otherwise tell each worker the load after a
scrape, and what is tested here is the gateway's own, instant, shared counting.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.fleet import start_gateway

LONG = {"model": "m", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 3000, "stream": True}
ADMIN_KEY = "admin-secret-17"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@contextlib.asynccontextmanager
async def _connections(gw_url: str, wanted: int) -> AsyncIterator[dict[str, list[aiohttp.ClientSession]]]:
    """One-connection client sessions by worker pid, until one worker has ``wanted`` and the other one."""
    by_worker: dict[str, list[aiohttp.ClientSession]] = {}
    sessions: list[aiohttp.ClientSession] = []
    try:
        for _ in range(300):
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1), timeout=aiohttp.ClientTimeout(total=30)
            )
            sessions.append(session)
            async with session.get(gw_url + "/health") as resp:
                by_worker.setdefault(resp.headers["x-gateway-worker"], []).append(session)
            counts = sorted(len(v) for v in by_worker.values())
            if len(counts) == 2 and counts[0] >= 1 and counts[1] >= wanted:
                break
            if len(counts) < 2:  # the other worker may still be starting: /ready came from one
                await asyncio.sleep(0.05)
        else:
            pytest.fail(f"connections never reached both workers: {by_worker.keys()}")
        yield by_worker
    finally:
        for session in sessions:
            await session.close()


def _busy_and_other(by_worker: dict[str, list[aiohttp.ClientSession]], wanted: int) -> tuple[str, str]:
    busy = next(pid for pid, sessions in by_worker.items() if len(sessions) >= wanted)
    other = next(pid for pid in by_worker if pid != busy)
    return busy, other


async def _in_flight_seen_by(session: aiohttp.ClientSession, gw_url: str) -> dict[str, int]:
    async with session.get(gw_url + "/debug/endpoints") as resp:
        rows = (await resp.json())["endpoints"]
    return {row["url"]: row["in_flight"] for row in rows}


async def _gateway(start_sim, tmp_path, policy: str, config: str, replicas: int = 2, **sim):
    """``replicas`` simulators behind ``serve --workers 2 --policy policy`` with ``config`` as its file."""
    sims = [await start_sim(model="m", **sim) for _ in range(replicas)]
    path = tmp_path / "gateway.yaml"
    path.write_text(config)
    argv = ["--workers", "2", "--policy", policy, "--config", str(path)]
    return sims, await start_gateway([s.url for s in sims], argv, log_dir=tmp_path)


NO_SCRAPES = "scrape:\n  enabled: false\n"


async def test_streams_held_by_one_worker_steer_the_others_requests(start_sim, tmp_path):
    _sims, gw = await _gateway(start_sim, tmp_path, "least-load", NO_SCRAPES, time_scale=1.0)
    try:
        async with _connections(gw.url, 3) as by_worker:
            busy, other = _busy_and_other(by_worker, 3)
            streams = [await s.post(gw.url + "/v1/chat/completions", json=LONG) for s in by_worker[busy][:3]]
            try:
                held = [r.headers["x-gateway-endpoint"] for r in streams]
                loaded = max(set(held), key=held.count)  # 2 of the 3 streams; the other replica has 1
                assert sorted(held.count(e) for e in set(held)) == [1, 2], held
                quiet = by_worker[other][0]
                seen = await _in_flight_seen_by(quiet, gw.url)
                assert sum(seen.values()) == 3, seen  # the other worker counts the busy one's streams
                served = []
                for _ in range(10):  # one at a time: each sees 2 vs 1 and takes the lighter replica
                    async with quiet.post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                        assert resp.status == 200
                        assert resp.headers["x-gateway-worker"] == other
                        served.append(resp.headers["x-gateway-endpoint"])
                assert loaded not in served, served
            finally:
                for stream in streams:
                    stream.close()
    finally:
        await gw.stop()


async def test_a_killed_workers_requests_stop_counting(start_sim, tmp_path):
    _sims, gw = await _gateway(start_sim, tmp_path, "least-load", NO_SCRAPES, time_scale=1.0)
    try:
        async with _connections(gw.url, 2) as by_worker:
            busy, other = _busy_and_other(by_worker, 2)
            streams = [await s.post(gw.url + "/v1/chat/completions", json=LONG) for s in by_worker[busy][:2]]
            quiet = by_worker[other][0]
            assert sum((await _in_flight_seen_by(quiet, gw.url)).values()) == 2
            os.kill(int(busy), signal.SIGKILL)
            for stream in streams:
                stream.close()
            seen: dict[str, int] = {}
            for _ in range(50):  # the parent notices the death and clears the worker's cells
                seen = await _in_flight_seen_by(quiet, gw.url)
                if sum(seen.values()) == 0:
                    break
                await asyncio.sleep(0.1)
            assert sum(seen.values()) == 0, seen
            async with quiet.post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                assert resp.status == 200  # the surviving worker serves on
    finally:
        await gw.stop()


async def test_a_conversation_follows_its_prefix_whichever_worker_a_turn_reaches(start_sim, tmp_path):
    _sims, gw = await _gateway(start_sim, tmp_path, "prefix-aware", "{}\n", replicas=3)
    try:
        async with _connections(gw.url, 1) as by_worker:
            first, second = list(by_worker)
            for conversation in range(6):
                system = f"conversation {conversation}: " + "a long shared system prompt. " * 40
                messages = [{"role": "system", "content": system}]
                served, predicted = [], []
                for turn in range(4):  # alternate workers: every second turn is the other worker's
                    session = by_worker[(first, second)[turn % 2]][0]
                    messages.append({"role": "user", "content": f"question {turn} " * 5})
                    body = {"model": "m", "messages": messages, "max_tokens": 8}
                    async with session.post(
                        gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}
                    ) as resp:
                        assert resp.status == 200, await resp.text()
                        answer = (await resp.json())["choices"][0]["message"]["content"]
                        served.append(resp.headers["x-gateway-endpoint"])
                        predicted.append(int(resp.headers["x-gateway-predicted-cached-tokens"]))
                    messages.append({"role": "assistant", "content": answer})
                assert len(set(served)) == 1, (conversation, served)
                assert all(p > 0 for p in predicted[1:]), predicted  # each worker knew what the other sent
    finally:
        await gw.stop()


async def _ejected_seen_by(session: aiohttp.ClientSession, gw_url: str) -> set[str]:
    async with session.get(gw_url + "/debug/endpoints") as resp:
        return {row["url"] for row in (await resp.json())["endpoints"] if row["ejected"]}


async def test_an_endpoint_ejected_by_one_worker_is_out_of_the_others_rotation(start_sim, tmp_path, http):
    breaker = "resilience:\n  consecutive_failures: 2\n  ejection_s: 30\n"
    sims, gw = await _gateway(start_sim, tmp_path, "round-robin", breaker, replicas=3)
    try:
        async with _connections(gw.url, 1) as by_worker:
            busy, other = list(by_worker)
            failing = sims[0].url
            async with http.post(failing + "/admin/fault", json={"mode": "error", "status": 500}) as resp:
                assert resp.status == 200
            for _ in range(12):  # round-robin: the busy worker's requests meet the failing replica
                async with by_worker[busy][0].post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                    await resp.read()
                if failing in await _ejected_seen_by(by_worker[busy][0], gw.url):
                    break
            assert failing in await _ejected_seen_by(by_worker[busy][0], gw.url)
            quiet = by_worker[other][0]
            for _ in range(30):  # adopted at the other worker's next breaker review
                if failing in await _ejected_seen_by(quiet, gw.url):
                    break
                await asyncio.sleep(0.1)
            assert await _ejected_seen_by(quiet, gw.url) == {failing}
            for _ in range(6):
                async with quiet.post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-gateway-worker"] == other
                    assert "http://" + resp.headers["x-gateway-endpoint"] != failing
    finally:
        await gw.stop()


async def _admin_rows(session: aiohttp.ClientSession, gw_url: str) -> dict[str, dict]:
    async with session.get(gw_url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200
        return {row["url"]: row for row in (await resp.json())["endpoints"]}


async def _until_other_sees(session, gw_url: str, check) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for _ in range(30):
        rows = await _admin_rows(session, gw_url)
        if check(rows):
            return rows
        await asyncio.sleep(0.1)
    return rows


async def test_admin_changes_through_one_worker_reach_the_other(start_sim, tmp_path):
    auth = f"auth:\n  admin_key_sha256: {hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}\n"
    _sims, gw = await _gateway(start_sim, tmp_path, "round-robin", auth)
    added = await start_sim(model="m")
    try:
        async with _connections(gw.url, 1) as by_worker:
            first, second = (by_worker[pid][0] for pid in by_worker)
            async with first.post(
                gw.url + "/admin/endpoints", json={"url": added.url}, headers=ADMIN
            ) as resp:
                assert resp.status == 201, await resp.text()
            rows = await _until_other_sees(second, gw.url, lambda r: added.url in r)
            assert rows[added.url]["source"] == "admin"
            async with second.post(
                gw.url + "/admin/endpoints/drain", json={"url": added.url}, headers=ADMIN
            ) as r:
                assert r.status == 200
            rows = await _until_other_sees(first, gw.url, lambda r: r[added.url]["draining"])
            assert rows[added.url]["draining"]
            async with first.delete(
                gw.url + "/admin/endpoints", params={"url": added.url}, headers=ADMIN
            ) as r:
                assert r.status == 200
            rows = await _until_other_sees(second, gw.url, lambda r: added.url not in r)
            assert added.url not in rows
    finally:
        await gw.stop()


async def test_metrics_through_either_worker_count_every_workers_requests(start_sim, tmp_path):
    _sims, gw = await _gateway(start_sim, tmp_path, "round-robin", "{}\n")
    try:
        async with _connections(gw.url, 1) as by_worker:
            first, second = (by_worker[pid][0] for pid in by_worker)
            for session, count in ((first, 3), (second, 5)):
                for _ in range(count):
                    async with session.post(gw.url + "/v1/chat/completions", json=SHORT) as resp:
                        assert resp.status == 200
            for session in (first, second):
                async with session.get(gw.url + "/metrics") as resp:
                    text = await resp.text()
                served: dict[str, float] = {}
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name == "llm_gateway_requests_total":
                            worker = sample.labels["worker"]
                            served[worker] = served.get(worker, 0) + sample.value
                assert sorted(served.values()) == [3, 5], served  # both workers' series, one scrape
    finally:
        await gw.stop()
