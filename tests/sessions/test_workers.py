"""``--workers 2``: stickiness and session tokens hold whichever worker a connection reaches.

A real ``llm-gateway serve --workers 2`` process (the kernel spreads connections across
the workers by SO_REUSEPORT) in front of three simulators; every request is sent on a
fresh connection, so a conversation's turns land on both workers. The memory store is
per worker: a worker without a pin uses the same hashed placement as the other, and the
replica token's secret is generated once by the parent. ``/ready`` comes from whichever
worker listens first, so each test first waits until both workers answer and each sees the
whole fleet healthy (a late worker that routed on a partial view would move a session, and
one not yet listening would leave the test on one worker: it would prove nothing).
"""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp

from loadtest.fleet import start_gateway
from tests.support.workers import by_worker, spawn_gateway

TURNS = 10  # fresh connections per conversation: both workers see each conversation


async def _both_workers_see_the_fleet(gw_url: str, replicas: int) -> None:
    """Fresh connections until each of the two workers has reported every replica healthy."""
    ready: set[str] = set()
    for _ in range(400):
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.get(gw_url + "/debug/endpoints") as resp:
                rows = (await resp.json())["endpoints"]
                if sum(row["healthy"] for row in rows) == replicas:
                    ready.add(resp.headers["x-gateway-worker"])
        if len(ready) == 2:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"workers with the whole fleet healthy: {ready}")


async def _turn(
    gw_url: str, headers: dict[str, str], workers: set[str] | None = None
) -> tuple[str, str | None]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    connector = aiohttp.TCPConnector(force_close=True)  # a new TCP connection every time
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.post(gw_url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            if workers is not None:
                workers.add(resp.headers["x-gateway-worker"])
            return resp.headers["x-gateway-endpoint"], resp.headers.get("x-session-token")


async def test_conversations_stay_on_one_replica_across_two_workers(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(3)]
    gw = await start_gateway(
        [s.url for s in sims], ["--workers", "2", "--policy", "session-aware"], log_dir=tmp_path
    )
    try:
        await _both_workers_see_the_fleet(gw.url, len(sims))
        replicas_used, workers = set(), set()
        for conversation in range(6):
            headers = {"x-session-id": f"conversation-{conversation}"}
            served = [await _turn(gw.url, headers, workers) for _ in range(TURNS)]
            endpoints = {endpoint for endpoint, _ in served}
            assert len(endpoints) == 1, f"conversation {conversation}: {served}"
            replicas_used |= endpoints
        assert len(replicas_used) > 1  # sessions are spread, not all on one replica
        assert len(workers) == 2  # 60 fresh connections reached both workers
    finally:
        await gw.stop()


async def test_a_session_token_from_one_worker_is_honoured_by_the_other(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(3)]
    gw = await start_gateway(
        [s.url for s in sims], ["--workers", "2", "--policy", "session-aware"], log_dir=tmp_path
    )
    try:
        await _both_workers_see_the_fleet(gw.url, len(sims))
        for _ in range(3):  # three clients without a session id, each sticking by its token
            endpoint, token = await _turn(gw.url, {})
            assert token
            replays = [await _turn(gw.url, {"x-session-token": token}) for _ in range(TURNS)]
            assert {e for e, _ in replays} == {endpoint}, replays
            assert {t for _, t in replays} == {token}  # the same token back: same secret everywhere
    finally:
        await gw.stop()


ADMIN_KEY = "workers-sessions-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _turn_on(http: aiohttp.ClientSession, gw_url: str, session: str) -> str:
    async with http.post(gw_url + "/v1/chat/completions", json=HI, headers={"x-session-id": session}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-gateway-endpoint"]


async def _set_drain(by_pid: dict, gw_url: str, url: str, draining: bool) -> None:
    """Drain (or undrain) through one worker, then wait until every worker shows it."""
    first = next(iter(by_pid.values()))[0]
    action = "drain" if draining else "undrain"
    async with first.post(gw_url + f"/admin/endpoints/{action}", json={"url": url}, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
    for _ in range(200):
        states = []
        for http, *_ in by_pid.values():
            async with http.get(gw_url + "/admin/endpoints", headers=ADMIN) as resp:
                rows = (await resp.json())["endpoints"]
            states.append(next(r["draining"] for r in rows if r["url"] == url))
        if states == [draining] * len(by_pid):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"workers never all showed draining={draining}: {states}")


async def test_a_session_moved_by_one_worker_stays_moved_on_the_other(start_sim, tmp_path):
    """A session's replica is drained: the worker serving the next turn moves it. Once the
    replica is back, the sibling worker must not send the session back to its hashed replica
    (it did while pins were per worker: the conversation then ran on two replicas' caches)."""
    sims = [await start_sim(model="m") for _ in range(3)]
    config = tmp_path / "gw.yaml"
    config.write_text(f"auth:\n  admin_key_sha256: {hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}\n")
    args = ["--workers", "2", "--policy", "session-aware", "--config", str(config)]
    gw = await spawn_gateway([s.url for s in sims], args, tmp_path)
    try:
        await _both_workers_see_the_fleet(gw.url, len(sims))
        async with by_worker(gw.url) as by_pid:
            (a, *_), (b, *_) = by_pid.values()
            url_of = {s.url.removeprefix("http://"): s.url for s in sims}  # endpoint name → URL
            for session in (f"moved-{i}" for i in range(4)):
                hashed = await _turn_on(a, gw.url, session)
                assert await _turn_on(b, gw.url, session) == hashed  # b: the same hashed replica
                hashed_url = url_of[hashed]
                await _set_drain(by_pid, gw.url, hashed_url, True)
                moved = await _turn_on(a, gw.url, session)
                assert moved != hashed
                await _set_drain(by_pid, gw.url, hashed_url, False)
                served = [await _turn_on(http, gw.url, session) for http in (b, a) * 3]
                assert served == [moved] * 6, (session, hashed, moved, served)
    finally:
        await gw.stop()


async def test_turns_alternating_workers_on_kept_alive_connections_never_move(start_sim, tmp_path):
    """The next turn reaches the other worker within a millisecond of the last answer (kept-alive
    connections). Its view of the load must already be without that answer's request: a sibling's
    count read up to 1 ms old moved a conversation off its replica (one in-flight request more
    there outweighs session affinity), about one turn in 300: 1,280 turns here."""
    sims = [await start_sim(model="m") for _ in range(3)]
    gw = await spawn_gateway([s.url for s in sims], ["--workers", "2", "--policy", "session-aware"], tmp_path)
    try:
        await _both_workers_see_the_fleet(gw.url, len(sims))
        async with by_worker(gw.url) as by_pid:
            (a, *_), (b, *_) = by_pid.values()
            for session in (f"alternating-{i}" for i in range(8)):
                served = [await _turn_on(http, gw.url, session) for http in (a, b) * 80]
                assert len(set(served)) == 1, (session, [i for i, e in enumerate(served) if e != served[0]])
    finally:
        await gw.stop()
