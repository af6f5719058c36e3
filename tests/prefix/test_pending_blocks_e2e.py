"""Pending blocks end to end (``prefix.kv_events.pending_blocks``): two simulators publishing KV
events, an in-process gateway, two requests with one long prefix sent back to back — the
second routed before the first's BlockStored arrives. With pending blocks the second goes
where the first is being prefilled (and hits there); without, the exact index sees no hit
anywhere and load sends it to the other replica. The predicted cached tokens stay what the
engines reported either way, and the pending blocks are gone after their grace."""

from __future__ import annotations

import asyncio

import pytest

from gateway.http.state import STATE
from tests.prefix.conftest import gateway_config
from tests.prefix.test_exact_prefix_e2e import ask, exact_of, name_of, wait_live

DOCUMENT = "A shared document: " + " ".join(f"w{i}" for i in range(1500))


@pytest.mark.parametrize("pending", [True, False], ids=["pending-on", "pending-off"])
async def test_back_to_back_shared_prefix_goes_where_it_is_being_cached(
    start_sims, start_gateway, http, pending: bool
) -> None:
    sims = await start_sims(2, kv_blocks=512, kv_events=True, time_scale=0.25)  # prefill ~0.2 s
    kv_events = {"rediscover_s": 0.3, "pending_blocks": pending, "pending_grace_s": 0.3}
    config = gateway_config([s.url for s in sims], policy="prefix-aware", prefix={"kv_events": kv_events})
    gw = await start_gateway(config)
    await wait_live(gw, sims)
    assert gw.gateway is not None
    registry = gw.gateway.app[STATE].registry
    index = exact_of(gw).index

    first = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "question one"}]
    second = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "question two"}]
    task = asyncio.create_task(ask(http, gw, first))
    async with asyncio.timeout(5):
        while sum(e.in_flight for e in registry) == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
    assert all(index.size(name_of(s)) == 0 for s in sims)  # nothing reported stored yet
    pending_now = sum(index.pending_size(name_of(s)) for s in sims)
    assert pending_now > 1500 // 16 if pending else pending_now == 0  # the prompt's full blocks
    endpoint2, predicted2, cached2, _ = await ask(http, gw, second)
    endpoint1, predicted1, cached1, _ = await task

    # Routed before any BlockStored: the engine-exact prediction is 0 for both, pending or not
    # (the header never counts pending blocks).
    assert predicted1 == 0 and cached1 == 0
    assert predicted2 == 0
    if pending:
        assert endpoint2 == endpoint1
        assert cached2 > 1400  # it waited for the first's prefill there and hit the document
    else:
        assert endpoint2 != endpoint1 and cached2 == 0

    await asyncio.sleep(0.4)  # past the grace: confirmed by BlockStored or expired, none left
    assert all(index.pending_size(name_of(s)) == 0 for s in sims)
    assert index.size(endpoint1) > 0
