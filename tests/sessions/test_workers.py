"""``--workers 2``: stickiness and session tokens hold whichever worker a connection reaches.

A real ``llm-gateway serve --workers 2`` process (the kernel spreads connections across
the workers by SO_REUSEPORT) in front of three simulators; every request is sent on a
fresh connection, so a conversation's turns land on both workers. The memory store is
per worker: a worker without a pin uses the same hashed placement as the other, and the
replica token's secret is generated once by the parent.
"""

from __future__ import annotations

import aiohttp

from loadtest.fleet import start_gateway

TURNS = 10  # fresh connections per conversation: both workers see each conversation


async def _turn(gw_url: str, headers: dict[str, str]) -> tuple[str, str | None]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    connector = aiohttp.TCPConnector(force_close=True)  # a new TCP connection every time
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.post(gw_url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["x-gateway-endpoint"], resp.headers.get("x-session-token")


async def test_conversations_stay_on_one_replica_across_two_workers(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(3)]
    gw = await start_gateway(
        [s.url for s in sims], ["--workers", "2", "--policy", "session-aware"], log_dir=tmp_path
    )
    try:
        replicas_used = set()
        for conversation in range(6):
            headers = {"x-session-id": f"conversation-{conversation}"}
            served = [await _turn(gw.url, headers) for _ in range(TURNS)]
            endpoints = {endpoint for endpoint, _ in served}
            assert len(endpoints) == 1, (conversation, [e for e, _ in served])
            replicas_used |= endpoints
        assert len(replicas_used) > 1  # sessions are spread, not all on one replica
    finally:
        await gw.stop()


async def test_a_session_token_from_one_worker_is_honoured_by_the_other(start_sim, tmp_path):
    sims = [await start_sim(model="m") for _ in range(3)]
    gw = await start_gateway(
        [s.url for s in sims], ["--workers", "2", "--policy", "session-aware"], log_dir=tmp_path
    )
    try:
        for _ in range(3):  # three clients without a session id, each sticking by its token
            endpoint, token = await _turn(gw.url, {})
            assert token
            replays = [await _turn(gw.url, {"x-session-token": token}) for _ in range(TURNS)]
            assert {e for e, _ in replays} == {endpoint}, replays
            assert {t for _, t in replays} == {token}  # the same token back: same secret everywhere
    finally:
        await gw.stop()
