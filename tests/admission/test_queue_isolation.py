"""What one part of the load must not do to another: a replica at its own cap, a saturated model,
critical work at its cap, a Responses chain and the fallback model, the output cap per API.

Each case was a defect found by review: the per-endpoint cap only saturated the pool once every
replica reached it (so a replica at its cap kept being chosen); any queued request, of any model,
queued every new one and a tenant's waiter for a saturated model held its waiters for other models;
critical waiters at the critical cap held up standard and sheddable work that does not use that cap;
a pinned Responses continuation was switched to the fallback model its replica does not serve;
the sheddable clamp wrote ``max_tokens`` into Responses and embeddings bodies.
"""

from __future__ import annotations

import asyncio

from tests.admission.conftest import (
    FAST,
    IDLE,
    admission_gateway,
    assert_rate_limited,
    body,
    deep,
    gated,
    post,
    wait_queue,
    wait_saturation,
)
from tests.support.harness import wait_until
from tests.support.responses_replica import running_replica
from tests.support.upstreams import Upstream, vllm_metrics

SHARED = "a long shared system prompt " * 40  # the prefix scorer would pile these on one replica


def _shared_prefix(turn: int) -> dict:
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": f"turn {turn}"}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": True}


async def test_a_replica_at_its_cap_takes_no_more_while_another_has_room(
    stack, start_upstream, start_gateway, http, spawn
) -> None:
    ups = [await start_upstream(metrics_text=IDLE) for _ in range(2)]
    gw = await admission_gateway(
        start_gateway, [u.url for u in ups], policy="prefix-aware", endpoint_max_concurrency=1
    )
    for up in ups:
        gated(stack, up)
    held = [spawn(post(http, gw, _shared_prefix(i))) for i in range(2)]

    async def both_busy() -> bool:
        return sorted(len(u.requests) for u in ups) == [1, 1]

    await wait_until(both_busy, 3.0, "one held stream on each replica")
    third = spawn(post(http, gw, _shared_prefix(2)))
    await wait_queue(http, gw, 1)  # every replica at its cap: the third waits in the gateway
    assert sorted(len(u.requests) for u in ups) == [1, 1]
    for up in ups:
        up.gate.set()
    for task in (*held, third):
        status, _, _ = await task
        assert status == 200


async def test_a_saturated_model_holds_up_neither_new_requests_nor_queued_ones_for_another(
    start_upstream, start_gateway, http, spawn
) -> None:
    big = await start_upstream(models=("big",), metrics_text=deep("big"))
    small = await start_upstream(models=("small",), metrics_text=deep("small"))
    gw = await admission_gateway(start_gateway, [big.url, small.url], queue_timeout_s=5.0)
    await wait_saturation(http, gw, [big, small], 1)
    waiting_big = spawn(post(http, gw, body(model="big"), tenant="t"))
    await wait_queue(http, gw, 1)
    waiting_small = spawn(post(http, gw, body(model="small"), tenant="t"))  # same tenant, behind it
    await wait_queue(http, gw, 2)

    small.metrics_text = vllm_metrics(model="small")  # small's replica drains; big stays saturated
    status, _, _ = await asyncio.wait_for(waiting_small, 2.0)
    assert status == 200
    assert not waiting_big.done()

    for priority in ("standard", "sheddable"):  # with big's waiter still queued
        answer = post(http, gw, body(model="small"), priority=priority)
        status, _, payload = await asyncio.wait_for(answer, 2.0)
        assert status == 200, (priority, payload)
    big.metrics_text = vllm_metrics(model="big")
    status, _, _ = await asyncio.wait_for(waiting_big, 2.0)
    assert status == 200


async def test_critical_work_at_its_cap_holds_up_no_other_class(
    stack, start_upstream, start_gateway, http, spawn
) -> None:
    up = await start_upstream(metrics_text=IDLE)
    gw = await admission_gateway(start_gateway, [up.url], critical_max_concurrency=1)
    gated(stack, up)
    held = spawn(post(http, gw, body(stream=True), priority="critical"))
    await wait_until(lambda: _received(up, 1), 3.0, "the critical stream reached the upstream")
    waiting = spawn(post(http, gw, body(stream=True), priority="critical"))
    await wait_queue(http, gw, 1, priority="critical")

    up.mode = "ok"  # new streams complete; the held one stays held
    for priority in ("standard", "sheddable"):
        status, _, payload = await asyncio.wait_for(post(http, gw, body(), priority=priority), 2.0)
        assert status == 200, (priority, payload)
    assert not waiting.done()  # still at its own cap
    up.gate.set()
    assert (await held)[0] == 200
    assert (await asyncio.wait_for(waiting, 2.0))[0] == 200


async def _received(up: Upstream, n: int) -> bool:
    return len(up.requests) >= n


async def test_a_pinned_responses_continuation_is_shed_not_switched_to_the_fallback_model(
    stack, start_upstream, start_gateway, http
) -> None:
    chain = await stack.enter_async_context(running_replica("big"))
    other = await start_upstream(models=("small",), metrics_text=IDLE)
    gw = await start_gateway(
        [chain.url, other.url], admission={"degrade": {"fallback_model": "small"}}, **FAST
    )
    async with http.post(gw.url + "/v1/responses", json={"model": "big", "input": "hi"}) as resp:
        assert resp.status == 200
        first = (await resp.json())["id"]
    chain.metrics_text = deep("big")
    await wait_saturation(http, gw, [chain], 1)  # type: ignore[list-item]

    follow_up = {"model": "big", "input": "and then?", "previous_response_id": first}
    headers = {"x-priority": "sheddable"}
    async with http.post(gw.url + "/v1/responses", json=follow_up, headers=headers) as resp:
        assert_rate_limited(resp.status, resp.headers, await resp.json(), "saturated")  # type: ignore[arg-type]
    assert not other.requests  # not sent to the fallback model's replica either

    # Not pinned: the same request without a chain is served by the fallback model.
    status, headers_out, _ = await post(http, gw, body(model="big"), priority="sheddable")
    assert status == 200 and headers_out["x-gateway-degraded"] == "model=small"


async def test_the_sheddable_clamp_writes_each_apis_own_output_cap(
    start_upstream, start_gateway, http
) -> None:
    ups = [await start_upstream(metrics_text=deep()), await start_upstream(metrics_text=IDLE)]
    gw = await admission_gateway(start_gateway, [u.url for u in ups], degrade={"sheddable_max_tokens": 16})
    await wait_saturation(http, gw, ups[:1], 1)  # pressure 0.5
    await wait_saturation(http, gw, ups[1:], 0)
    headers = {"x-priority": "sheddable"}
    hello = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 999}, "max_output_tokens=16"),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4000, "messages": hello}, "max_tokens=16"),
        ("/v1/embeddings", {"model": "tiny", "input": "hi"}, None),
    ]
    for path, payload, degraded in cases:
        async with http.post(gw.url + path, json=payload, headers=headers) as resp:
            assert resp.status == 200, (path, await resp.text())
            assert resp.headers.get("x-gateway-degraded") == degraded, path
            request_id = resp.headers["x-request-id"]
        sent = next(r.json for u in ups for r in u.requests if r.headers.get("x-request-id") == request_id)
        if degraded is None:
            assert sent == payload, path  # nothing to shorten: untouched
        else:
            field, _, value = degraded.partition("=")
            assert sent[field] == int(value), path
            assert set(sent) == set(payload), path  # no other cap field added
