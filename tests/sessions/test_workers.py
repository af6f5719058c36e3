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

import aiohttp

from loadtest.fleet import start_gateway

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
            assert len(endpoints) == 1, (conversation, [e for e, _ in served])
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
