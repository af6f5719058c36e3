"""Queued requests with deadlines under timeouts and drops, and config reloads of the SLO settings."""

from __future__ import annotations

import asyncio
import random

from gateway.config import SloTarget
from gateway.http.reload import apply_config
from tests.admission.conftest import FAST, admission_gateway, body, gated, wait_queue
from tests.admission.test_latency_model_outliers import SlowFirstToken, _own, _predicted_ms, _stream
from tests.support.harness import gateway_metrics, metric_value, wait_until


async def _post(http, gw, payload, **headers: str) -> tuple[int, dict]:
    async with http.post(gw.url + "/v1/chat/completions", json=payload, headers=headers) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, {"text": await r.text()}


async def test_many_deadlines_and_a_queue_timeout_lose_nothing(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """One slot held; 40 standard requests queue, with tiny, loose and no objectives, across 3 tenants,
    with drop_overdue on; the queue times out at 1 s. Every one gets exactly one answer: 429 (deadline
    passed or queue timeout) or 200; none reaches the upstream twice; the gauges return to 0."""
    up = await start_upstream()
    gw = await admission_gateway(
        start_gateway, [up.url], max_concurrency=1, queue_timeout_s=1.0, slo={"drop_overdue": True}
    )
    gated(stack, up)
    holder = spawn(_post(http, gw, body("holder", stream=True)))
    await asyncio.wait_for(up.first_chunk_sent.wait(), 3)
    rng = random.Random(7)
    tasks = []
    for i in range(40):
        headers = {"x-tenant-id": f"t{i % 3}"}
        slo = rng.choice([None, "1", "5", "50", "400", "5000", "3600000"])
        if slo:
            headers["x-slo-ttft-ms"] = slo
        tasks.append(spawn(_post(http, gw, body(f"q{i}"), **headers)))
    results = await asyncio.gather(*tasks)
    codes = sorted({p["error"]["code"] for s, p in results if s == 429})
    assert {s for s, _ in results} == {429}, results
    assert set(codes) <= {"rate_limit_exceeded.slo_deadline_passed", "rate_limit_exceeded.queue_timeout"}
    up.gate.set()
    assert (await holder)[0] == 200
    assert len(up.requests) == 1
    state = gw.state
    assert state.admission.queued() == 0 and state.admission.in_flight == 0
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_admission_queue_length", priority="standard") == 0
    # and it keeps serving
    for _ in range(3):
        assert (await _post(http, gw, body(), **{"x-slo-ttft-ms": "100"}))[0] == 200


async def test_queued_deadlines_served_in_order_after_release(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """Without drop_overdue, the overdue are served late, not lost: 20 queued with 1 ms objectives."""
    up = await start_upstream()
    gw = await admission_gateway(start_gateway, [up.url], max_concurrency=1, queue_timeout_s=10)
    gated(stack, up)
    holder = spawn(_post(http, gw, body("holder", stream=True)))
    await asyncio.wait_for(up.first_chunk_sent.wait(), 3)
    tasks = [spawn(_post(http, gw, body(f"q{i}"), **{"x-slo-ttft-ms": "1"})) for i in range(20)]
    await wait_queue(http, gw, 20)
    await asyncio.sleep(0.2)  # every deadline passed in queue
    up.gate.set()
    results = await asyncio.gather(holder, *tasks)
    assert [s for s, _ in results] == [200] * 21
    contents = sorted(r.json["messages"][0]["content"] for r in up.requests[1:])
    assert contents == sorted(f"q{i}" for i in range(20))  # each exactly once


async def test_a_reload_of_min_samples_applies(stack, start_gateway, http) -> None:
    """Reload says admission settings change in place; admission.slo.min_samples does not: the latency
    model keeps the value it was built with, so a reload that lowers it changes nothing (silently)."""
    up = await _own(stack, SlowFirstToken())
    up.delay_s = 0.3
    gw = await start_gateway([up.url], policy="round-robin", admission={"slo": {"min_samples": 50}}, **FAST)
    for _ in range(6):
        assert (await _stream(http, gw))[0] == 200
    assert _predicted_ms(gw, up) > 150
    assert (await _stream(http, gw, "sheddable", **{"x-slo-ttft-ms": "50"}))[0] == 200  # not confident yet

    config = gw.state.config
    slo = config.admission.slo.model_copy(update={"min_samples": 3})
    await apply_config(
        gw.state, config.model_copy(update={"admission": config.admission.model_copy(update={"slo": slo})})
    )
    assert gw.state.config.admission.slo.min_samples == 3
    status, _ = await _stream(http, gw, "sheddable", **{"x-slo-ttft-ms": "50"})
    assert status == 429, ("min_samples after reload", gw.state.plugin_context.latency.min_samples)


async def test_a_reload_of_slo_defaults_while_requests_are_queued(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """Queued requests keep their deadlines; new defaults (and drop_overdue) apply; nothing is lost."""
    up = await start_upstream()
    gw = await admission_gateway(start_gateway, [up.url], max_concurrency=1, queue_timeout_s=5)
    gated(stack, up)
    holder = spawn(_post(http, gw, body("holder", stream=True)))
    await asyncio.wait_for(up.first_chunk_sent.wait(), 3)
    old = [spawn(_post(http, gw, body(f"old{i}"))) for i in range(5)]
    await wait_queue(http, gw, 5)
    config = gw.state.config
    slo = config.admission.slo.model_copy(
        update={"drop_overdue": True, "defaults": {"standard": SloTarget(ttft_ms=20)}}
    )
    await apply_config(
        gw.state, config.model_copy(update={"admission": config.admission.model_copy(update={"slo": slo})})
    )
    new = [spawn(_post(http, gw, body(f"new{i}"))) for i in range(5)]
    new_results = await asyncio.gather(*new)  # 20 ms default, drop_overdue: refused at their deadline
    assert [s for s, _ in new_results] == [429] * 5, new_results
    assert {p["error"]["code"] for _, p in new_results} == {"rate_limit_exceeded.slo_deadline_passed"}
    up.gate.set()
    old_results = await asyncio.gather(holder, *old)
    assert [s for s, _ in old_results] == [200] * 6
    await wait_until(lambda: asyncio.sleep(0, gw.state.admission.in_flight == 0), 2, "in_flight 0")
    assert gw.state.admission.queued() == 0
