"""A malformed ``/v1/models`` answer makes only that endpoint unhealthy, with the reason logged.

Regression: one replica answering ``{"data": [{"id": ["x"]}]}`` raised out of the probe
(an unhashable id), which failed the gateway's start-up round or, added at run time,
ended the health loop for good: a replica killed afterwards stayed "healthy" and
counted in ``/ready``.
"""

from __future__ import annotations

import contextlib
import logging

from tests.fleet.servers import Engine, running_engine
from tests.support.harness import chat_body, wait_until
from tests.web.test_admin import ADMIN, AUTH

MALFORMED = [
    {"data": [{"id": ["x"]}]},
    {"data": 5},
    {"data": [{"id": "ok-model"}, {"id": 7}]},
]


async def _ready_count(http, gw) -> int:
    async with http.get(gw.url + "/ready") as resp:
        return (await resp.json())["healthy_endpoints"]


async def test_malformed_model_lists_at_start_up_leave_the_rest_serving(
    stack: contextlib.AsyncExitStack, start_upstream, start_gateway, http, caplog
):
    caplog.set_level(logging.WARNING, logger="gateway.fleet.health")
    good = await start_upstream()
    bad = [await stack.enter_async_context(running_engine(Engine(models_payload=p))) for p in MALFORMED]
    gw = await start_gateway([good.url, *(b.url for b in bad)])

    rows = {e.name: e for e in gw.state.registry}
    assert rows[good.name].healthy
    assert [rows[b.name].healthy for b in bad] == [False, False, False]
    assert await _ready_count(http, gw) == 1
    for b in bad:
        assert any(b.name in r.getMessage() and "model" in r.getMessage() for r in caplog.records), b.name
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 200
        assert resp.headers.get("x-gateway-endpoint") == good.name


async def test_malformed_model_list_added_at_run_time_keeps_the_health_loop_running(
    stack: contextlib.AsyncExitStack, start_upstream, start_gateway, http, caplog
):
    caplog.set_level(logging.WARNING, logger="gateway.fleet.health")
    first, second = await start_upstream(), await start_upstream()
    gw = await start_gateway([first.url, second.url], auth=AUTH)
    assert await _ready_count(http, gw) == 2

    for payload in MALFORMED:
        bad = await stack.enter_async_context(running_engine(Engine(models_payload=payload)))
        async with http.post(gw.url + "/admin/endpoints", json={"url": bad.url}, headers=ADMIN) as resp:
            assert resp.status == 201, await resp.text()

    async def reasons_logged() -> bool:
        return sum("unusable model list" in r.getMessage() for r in caplog.records) >= len(MALFORMED)

    await wait_until(reasons_logged, 3.0, "each malformed model list to be logged")
    await wait_until(lambda: _is(http, gw, 2), 2.0, "the two good replicas to stay the only healthy ones")

    # The loop still runs: a replica killed now turns unhealthy and leaves /ready's count.
    await second.stop()
    await wait_until(lambda: _is(http, gw, 1), 4.0, "the killed replica to leave /ready")
    killed = next(e for e in gw.state.registry if e.name == second.name)
    assert not killed.healthy
    assert gw.state.metrics.task_restarts.labels("health-checks")._value.get() == 0


async def _is(http, gw, count: int) -> bool:
    return await _ready_count(http, gw) == count
