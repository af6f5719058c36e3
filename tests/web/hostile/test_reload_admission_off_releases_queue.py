"""A reload that turns admission control off releases the requests already queued, not only
the new ones (found by review, 2026-12-05: the queued ones waited for the old limit)."""

from __future__ import annotations

import asyncio

from gateway.http.reload import apply_config
from tests.support.harness import chat_body


async def _post(http, gw, **extra) -> int:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(**extra)) as resp:
        await resp.read()
        return resp.status


async def test_disabling_admission_releases_the_queued_requests(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], admission={"max_concurrency": 1, "queue_timeout_s": 3.0})
    state = gw.state
    upstream.mode = "gated"  # streams its first chunk, then waits for the gate
    holder = asyncio.create_task(_post(http, gw, stream=True))
    await asyncio.wait_for(upstream.first_chunk_sent.wait(), 2.0)
    queued = asyncio.create_task(_post(http, gw))  # max_concurrency 1: this one queues
    await asyncio.sleep(0.3)
    assert state.admission.queued() == 1

    upstream.mode = "ok"  # new requests are answered at once
    admission = state.config.admission.model_copy(update={"enabled": False})
    await apply_config(state, state.config.model_copy(update={"admission": admission}))
    assert await _post(http, gw) == 200  # a request sent after the reload goes straight through
    try:
        done, _ = await asyncio.wait({queued}, timeout=1.0)
        assert done, "the request queued before the reload still waits, admission being off"
        assert queued.result() == 200
    finally:
        upstream.gate.set()
        await asyncio.gather(holder, queued, return_exceptions=True)
