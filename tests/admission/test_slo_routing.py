"""SLO-aware routing and shedding end to end: a gateway learning from two simulated replicas.

The simulator prefills at 25 µs per token / time_scale (here 2: 12.5 µs). After a warm-up of
streamed requests of assorted lengths the gateway's latency model knows that cost, and:

- a request with a tight TTFT objective whose prefix one replica holds goes there while
  the prefix saves more than that replica's prefill queue costs, and elsewhere once the
  queue costs more (the queue is the gateway's own pending prefill count, set here);
- a sheddable request no replica can serve in time gets 429 + Retry-After — but only once
  the model has data: a cold gateway admits it (fail open);
- a standard request with an objective nobody can meet is still served.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from tests.support.harness import Gateway, gateway_metrics, metric_value, wait_until

MODEL = "sim-llama"
FAST = {"health": {"interval_s": 0.2, "timeout_s": 0.5}, "scrape": {"interval_s": 0.1, "timeout_s": 0.5}}
US_PER_TOKEN = 25.0 / 2  # the simulator's prefill cost at time_scale 2


def _prompt(tokens: int, seed: str) -> str:
    """``tokens`` words of 3 characters + a space: the gateway estimates 1 token per 4 characters,
    the simulator's tokenizer counts one per word, so both count ``tokens``."""
    rng = random.Random(seed)
    return " ".join(f"{chr(97 + rng.randrange(26))}{rng.randrange(100):02d}" for _ in range(tokens))


async def _stream(
    http: aiohttp.ClientSession, gw: Gateway, content: str, **headers: str
) -> tuple[int, Any, str | None]:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "stream": True,
    }
    async with http.post(gw.url + "/v1/chat/completions", json=payload, headers=headers) as resp:
        body: Any = await resp.json() if resp.content_type == "application/json" else await resp.text()
        if resp.status == 429:
            assert int(resp.headers["Retry-After"]) >= 1
        return resp.status, body, resp.headers.get("x-gateway-endpoint")


async def _slo_gateway(start_sim, start_gateway) -> Gateway:
    sims = [await start_sim(model=MODEL, time_scale=2.0) for _ in range(2)]
    return await start_gateway(
        [s.url for s in sims], policy="slo-aware", admission={"slo": {"min_samples": 5}}, **FAST
    )


async def _warm_up(http: aiohttp.ClientSession, gw: Gateway) -> None:
    rng = random.Random(3)
    for i in range(30):
        status, _, _ = await _stream(http, gw, _prompt(rng.randint(200, 6000), f"warm-{i}"))
        assert status == 200
    latency = gw.state.plugin_context.latency
    assert all(latency.confident(e) for e in gw.state.registry)
    learned = latency.coefficients()["ttft"]["prefill_tokens"] * 1000  # µs per token
    assert 0.5 * US_PER_TOKEN < learned < 2 * US_PER_TOKEN, latency.coefficients()


async def test_a_tight_ttft_objective_weighs_the_prefix_hit_against_the_prefill_queue(
    start_sim, start_gateway, http
) -> None:
    gw = await _slo_gateway(start_sim, start_gateway)
    await _warm_up(http, gw)
    shared = _prompt(6000, "shared")  # ~75 ms of prefill wherever it is not cached
    status, _, hot_name = await _stream(http, gw, shared)
    assert status == 200
    by_name = {e.name: e for e in gw.state.registry}
    hot = by_name[hot_name]
    (cold,) = (e for e in by_name.values() if e is not hot)
    follow_up = shared + " and one more question"
    tight = {"x-slo-ttft-ms": "250"}

    # A queue of 2,000 prefill tokens (~25 ms) costs less than the 6,000 the prefix saves.
    hot.pending_prefill_tokens += 2000
    try:
        status, _, chosen = await _stream(http, gw, follow_up, **tight)
    finally:
        hot.pending_prefill_tokens -= 2000
    assert (status, chosen) == (200, hot.name)

    # A queue of 40,000 (~500 ms) would blow the 250 ms objective: the cold replica it is.
    hot.pending_prefill_tokens += 40000
    try:
        status, _, chosen = await _stream(http, gw, follow_up + " again", **tight)
    finally:
        hot.pending_prefill_tokens -= 40000
    assert (status, chosen) == (200, cold.name)

    text = await gateway_metrics(http, gw)
    for endpoint in (hot, cold):
        for kind in ("predicted", "observed"):
            sample = f"llm_gateway_latency_model_{kind}_ttft_seconds_count"
            assert (metric_value(text, sample, endpoint=endpoint.name) or 0) > 0, (kind, endpoint.name)
    assert (metric_value(text, "llm_gateway_slo_requests_total", priority="standard", result="met") or 0) >= 2


async def test_sheddable_work_nobody_can_serve_in_time_is_refused_once_the_model_knows(
    start_sim, start_gateway, http
) -> None:
    gw = await _slo_gateway(start_sim, start_gateway)
    impossible = {"x-priority": "sheddable", "x-slo-ttft-ms": "2"}  # 4,000 tokens take ~50 ms
    status, _, _ = await _stream(http, gw, _prompt(4000, "cold"), **impossible)
    assert status == 200  # cold model: no confident prediction, so no shedding on a guess

    await _warm_up(http, gw)
    status, body, _ = await _stream(http, gw, _prompt(4000, "late"), **impossible)
    assert status == 429, body
    assert body["error"]["code"] == "rate_limit_exceeded.slo_unmeetable"
    assert "TTFT objective" in body["error"]["message"]

    loose = {"x-priority": "sheddable", "x-slo-ttft-ms": "60000"}
    assert (await _stream(http, gw, _prompt(4000, "loose"), **loose))[0] == 200
    standard = {"x-priority": "standard", "x-slo-ttft-ms": "2"}
    assert (await _stream(http, gw, _prompt(4000, "standard"), **standard))[0] == 200  # late, not shed
    no_slo = {"x-priority": "sheddable"}
    assert (await _stream(http, gw, _prompt(4000, "plain"), **no_slo))[0] == 200  # as before SLOs

    text = await gateway_metrics(http, gw)
    decisions = "llm_gateway_admission_decisions_total"
    assert metric_value(text, decisions, priority="sheddable", outcome="shed", reason="slo_unmeetable") == 1
    missed = metric_value(text, "llm_gateway_slo_requests_total", priority="standard", result="missed")
    assert missed == 1


async def _queued(http: aiohttp.ClientSession, gw: Gateway) -> float:
    text = await gateway_metrics(http, gw)
    return metric_value(text, "llm_gateway_admission_queue_length", priority="standard") or 0


async def test_a_standard_request_waits_in_the_gateway_until_a_replica_can_meet_its_deadline(
    start_sim, start_gateway, http
) -> None:
    """Both replicas predicted ~500 ms behind prefill queues: a 1.5 s objective is not sent into
    one of them; when the queues clear it goes, and meets its deadline."""
    gw = await _slo_gateway(start_sim, start_gateway)
    await _warm_up(http, gw)
    endpoints = list(gw.state.registry)
    for endpoint in endpoints:
        endpoint.pending_prefill_tokens += 120_000  # ~1.5 s each at 12.5 µs per token
    cleared = False
    try:
        task = asyncio.ensure_future(_stream(http, gw, _prompt(500, "held"), **{"x-slo-ttft-ms": "1500"}))

        async def held() -> bool:
            return await _queued(http, gw) == 1

        await wait_until(held, 1.0, "the request held in the gateway's queue")
        await asyncio.sleep(0.2)
        assert not task.done()
        for endpoint in endpoints:
            endpoint.pending_prefill_tokens -= 120_000
        cleared = True
        status, _, _ = await asyncio.wait_for(task, 3)
    finally:
        if not cleared:
            for endpoint in endpoints:
                endpoint.pending_prefill_tokens -= 120_000
    assert status == 200
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_admission_decisions_total", priority="standard",
                        outcome="admitted", reason="dequeued") == 1  # fmt: skip
    assert metric_value(text, "llm_gateway_slo_requests_total", priority="standard", result="met") >= 1


async def test_with_drop_overdue_a_held_request_leaves_the_queue_at_its_deadline_with_429(
    start_sim, start_gateway, http
) -> None:
    sims = [await start_sim(model=MODEL, time_scale=2.0) for _ in range(2)]
    slo = {"min_samples": 5, "drop_overdue": True}
    gw = await start_gateway([s.url for s in sims], policy="slo-aware", admission={"slo": slo}, **FAST)
    await _warm_up(http, gw)
    endpoints = list(gw.state.registry)
    for endpoint in endpoints:
        endpoint.pending_prefill_tokens += 120_000
    try:
        started = asyncio.get_running_loop().time()
        status, body, _ = await _stream(http, gw, _prompt(500, "doomed"), **{"x-slo-ttft-ms": "300"})
        waited = asyncio.get_running_loop().time() - started
        # Without an objective the same request is not held: served at once, queues or not.
        plain_status, _, _ = await _stream(http, gw, _prompt(500, "plain"))
    finally:
        for endpoint in endpoints:
            endpoint.pending_prefill_tokens -= 120_000
    assert status == 429, body
    assert body["error"]["code"] == "rate_limit_exceeded.slo_deadline_passed"
    assert 0.25 <= waited < 2.0, waited  # refused at its deadline, not at queue_timeout_s
    assert plain_status == 200
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_admission_decisions_total", priority="standard",
                        outcome="shed", reason="slo_deadline_passed") == 1  # fmt: skip
    assert await _queued(http, gw) == 0


async def test_debug_answers_carry_the_predicted_ttft_the_routing_used(
    start_sim, start_gateway, http
) -> None:
    gw = await _slo_gateway(start_sim, start_gateway)
    await _warm_up(http, gw)
    payload = {"model": MODEL, "messages": [{"role": "user", "content": _prompt(3000, "dbg")}],
               "max_tokens": 3, "stream": True}  # fmt: skip
    debug = {"x-gateway-debug": "1"}
    async with http.post(gw.url + "/v1/chat/completions", json=payload, headers=debug) as resp:
        assert resp.status == 200
        predicted = float(resp.headers["x-gateway-predicted-ttft-ms"])
        await resp.read()
    # 3,000 uncached tokens at the learned ~12.5 µs each: tens of milliseconds, not zero or seconds.
    assert 10 < predicted < 500, predicted
    async with http.post(gw.url + "/v1/chat/completions", json=payload) as resp:
        assert "x-gateway-predicted-ttft-ms" not in resp.headers  # only when asked for
        await resp.read()
