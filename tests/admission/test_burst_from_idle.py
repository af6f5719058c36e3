"""A step burst from an idle fleet: 150 requests at once on two replicas with 2 batch slots.

Regression: the saturation detector counted requests sent since the last scrape only if
the engine was already queueing at that scrape, so a burst from idle was admitted in
full (150 of 150) and queued inside the engines until the next scrape. Now the gateway
counts its own in-flight work beyond each replica's batch capacity as queued at once:
sheddable work is refused from the start of the burst, critical work is all served,
and every request gets exactly one answer.

With nothing configured on a fleet that never queued, the capacity is unknown (engines do
not export ``max_num_seqs``): then the in-flight jump itself triggers a scrape at once,
which shows the engines queueing — the gateway's defaults alone must pass the same checks,
whatever the scrape interval.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import openai
import pytest

from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.fleet.endpoint import Endpoint
from loadtest.fleet import start_gateway as start_fleet_gateway
from tests.admission.conftest import FAST, body, gated, metric, post, wait_saturation
from tests.support.harness import gateway_metrics, metric_value, wait_until
from tests.support.upstreams import vllm_metrics

MODEL = "sim-llama"
SLOTS = 2
QUEUE_THRESHOLD = 5  # the admission default
CLASSES = ["critical"] * 30 + ["standard"] * 60 + ["sheddable"] * 60


async def _send(client: openai.AsyncOpenAI, priority: str, index: int) -> tuple[str, int]:
    try:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{priority} {index}: a short answer please"}],
            max_tokens=32,
            extra_headers={"x-priority": priority},
        )
    except openai.RateLimitError as exc:
        assert int(exc.response.headers["retry-after"]) >= 1
        return priority, 429
    except openai.APIStatusError as exc:
        return priority, exc.status_code
    return priority, 200


async def _burst(client: openai.AsyncOpenAI) -> Counter[tuple[str, int]]:
    classes = list(CLASSES)
    random.Random(7).shuffle(classes)
    results = await asyncio.gather(*(_send(client, p, i) for i, p in enumerate(classes)))
    assert len(results) == len(CLASSES)
    return Counter(results)


def _finished(sims) -> int:
    return sum(sum(s.engine.state()["finished"].values()) for s in sims)


def _check(by_class: Counter[tuple[str, int]], sims, finished_before: int = 0) -> None:
    assert by_class[("critical", 200)] == 30, by_class
    assert {status for _, status in by_class} <= {200, 429}, by_class  # no 5xx, nothing else
    # Before the pool counts as saturated each replica holds at most its slots plus the
    # queue threshold: at most that many sheddable requests get in, the rest are shed.
    admitted_sheddable = by_class[("sheddable", 200)]
    assert admitted_sheddable <= len(sims) * (SLOTS + QUEUE_THRESHOLD), by_class
    assert by_class[("sheddable", 429)] >= 60 - len(sims) * (SLOTS + QUEUE_THRESHOLD), by_class
    ok = sum(n for (_, status), n in by_class.items() if status == 200)
    assert _finished(sims) - finished_before == ok  # one engine request per 200: none lost or duplicated


async def test_burst_from_idle_with_configured_capacity_and_slow_scrapes(
    start_sim, start_gateway, openai_client
) -> None:
    sims = [await start_sim(model=MODEL, max_num_seqs=SLOTS, time_scale=4.0) for _ in range(2)]
    gw = await start_gateway(
        [{"url": s.url, "max_num_seqs": SLOTS} for s in sims],
        scrape={"interval_s": 5.0, "timeout_s": 0.5, "stale_after_s": 30.0},
    )
    _check(await _burst(openai_client(gw)), sims)


@pytest.mark.parametrize("interval_s", [1.0, 5.0])
async def test_burst_from_a_fresh_idle_fleet_with_the_defaults(
    start_sim, start_gateway, openai_client, http, interval_s: float
) -> None:
    """The issue's repro as a new user runs it: no capacity configured, never queued before."""
    sims = [await start_sim(model=MODEL, max_num_seqs=SLOTS, time_scale=4.0) for _ in range(2)]
    scrape = {"interval_s": interval_s, "stale_after_s": 30.0}
    gw = await start_gateway([s.url for s in sims], scrape=scrape)
    assert all(e.learned_capacity == 0 and e.max_num_seqs is None for e in gw.state.registry)
    _check(await _burst(openai_client(gw)), sims)
    assert all(e.learned_capacity == SLOTS for e in gw.state.registry)  # taught by the burst's scrapes
    text = await gateway_metrics(http, gw)
    for endpoint in gw.state.registry:
        assert metric_value(text, "llm_gateway_burst_scrapes_total", endpoint=endpoint.name) >= 1


async def test_burst_from_idle_through_a_serve_process(start_sim, tmp_path) -> None:
    """The same through a real ``llm-gateway serve``: the burst arrives over the wire at once.

    A first look at the engines then often finds them idle — the requests are counted as
    sent before their connections are open — so the triggered scrape must look again until
    the engines hold what was sent (fails with one look: all 60 sheddable admitted)."""
    sims = [await start_sim(model=MODEL, max_num_seqs=SLOTS, time_scale=4.0) for _ in range(2)]
    gw = await start_fleet_gateway([s.url for s in sims], log_dir=tmp_path)
    try:
        client = openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="none", max_retries=0,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=60),
        )  # fmt: skip
        async with client:
            _check(await _burst(client), sims)
    finally:
        await gw.stop()


async def test_no_burst_scrape_once_the_capacity_is_known(
    start_sim, start_gateway, openai_client, http
) -> None:
    sims = [await start_sim(model=MODEL, max_num_seqs=SLOTS, time_scale=4.0) for _ in range(2)]
    gw = await start_gateway(
        [{"url": s.url, "max_num_seqs": SLOTS} for s in sims],
        scrape={"interval_s": 5.0, "stale_after_s": 30.0},
    )
    _check(await _burst(openai_client(gw)), sims)
    text = await gateway_metrics(http, gw)
    assert not metric_value(text, "llm_gateway_burst_scrapes_total")  # none: no series at all


async def test_burst_from_idle_with_capacity_learned_from_an_earlier_queue(
    start_sim, start_gateway, openai_client
) -> None:
    sims = [await start_sim(model=MODEL, max_num_seqs=SLOTS, time_scale=4.0) for _ in range(2)]
    gw = await start_gateway(
        [s.url for s in sims], scrape={"interval_s": 1.0, "timeout_s": 0.5, "stale_after_s": 30.0}
    )
    client = openai_client(gw)
    endpoints = list(gw.state.registry)

    # An earlier busy spell: long answers queue in the engines while a scrape looks.
    async def long_answer(i: int) -> None:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"warm {i}"}], max_tokens=400
        )

    warm = [asyncio.create_task(long_answer(i)) for i in range(16)]

    async def learned() -> bool:
        return all(e.learned_capacity == SLOTS for e in endpoints)

    await wait_until(learned, 6.0, "the replicas' batch capacity to be learned")
    await asyncio.gather(*warm)

    async def idle() -> bool:  # drained, and a scrape has seen it drained
        return all(e.in_flight == 0 and e.metrics.waiting == 0 and e.metrics.running == 0 for e in endpoints)

    await wait_until(idle, 4.0, "an idle fleet")
    before = _finished(sims)
    _check(await _burst(client), sims, before)


def test_the_queue_estimate_shrinks_as_requests_finish_between_slow_scrapes() -> None:
    """A scrape saw 10 waiting with 12 in flight; 4 have finished since: 4 of the waiting got in.

    Without this a 5 s scrape interval kept the burst's queue "seen" for the whole 5 s after
    the engines had drained it, and standard requests queued in the gateway meanwhile."""
    detector = SaturationDetector(AdmissionConfig())
    endpoint = Endpoint(url="http://127.0.0.1:9")
    endpoint.metrics.waiting, endpoint.metrics.running = 10.0, 2.0
    endpoint.metrics.scraped_at, endpoint.metrics.stale = time.monotonic(), False
    endpoint.metrics.in_flight_at_scrape = endpoint.in_flight = 12
    assert detector.estimated_waiting(endpoint) == 10
    endpoint.in_flight = 8
    assert detector.estimated_waiting(endpoint) == 6
    endpoint.in_flight = 14  # and what is sent since joins the queue
    assert detector.estimated_waiting(endpoint) == 12
    endpoint.in_flight = 0
    assert detector.estimated_waiting(endpoint) == 0


async def test_requests_waiting_in_the_gateways_pool_do_not_shrink_the_engines_queue(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """4 connections to the replica, 7 requests: 4 sent, 3 wait in the gateway's pool. The engine
    shows 2 waiting, so the queue is 2 + 3 = 5, the threshold. The pooled 3 were in flight at the
    scrape but never reached the engine: they must not count as "finished since" (7 in flight at
    the scrape, 4 sent now) and take the engine's 2 waiting away."""
    up = await start_upstream(metrics_text=vllm_metrics(waiting=2, running=8, model="tiny"))
    gw = await start_gateway(
        [up.url], policy="round-robin", limits={"upstream_connections_per_endpoint": 4}, **FAST
    )
    gated(stack, up)
    held = [spawn(post(http, gw, body(f"held {i}", stream=True), priority="critical")) for i in range(7)]

    async def pooled() -> bool:
        return (
            len(up.requests) == 4
            and await metric(http, gw, "llm_gateway_endpoint_pool_waiting_requests", endpoint=up.name) == 3
        )

    await wait_until(pooled, 3.0, "4 requests at the replica, 3 in the gateway's pool")
    await wait_saturation(http, gw, [up], 1)
    up.gate.set()
    assert [status for status, _, _ in await asyncio.gather(*held)] == [200] * len(held)
