"""Admission against a real engine queue: a simulator with 2 batch slots and long outputs.

A first wave of long requests fills the engine (2 running, the rest waiting ≥ 5), the
gateway's scrape sees the deep queue, and a mixed second wave is admitted by priority.
Every request sent gets exactly one answer — 200 or 429 — and the engine finished
exactly as many requests as were answered 200 (nothing duplicated, nothing lost).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import openai

from tests.admission.conftest import metric
from tests.support.harness import gateway_metrics, metric_value, wait_until

MODEL = "sim-llama"


async def _send(client: openai.AsyncOpenAI, priority: str, index: int, max_tokens: int) -> tuple[str, int]:
    try:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{priority} request {index} please write at length"}],
            max_tokens=max_tokens,
            extra_headers={"x-priority": priority},
        )
    except openai.RateLimitError as exc:
        assert exc.body["type"] == "rate_limit_exceeded"
        assert int(exc.response.headers["retry-after"]) >= 1
        return priority, 429
    return priority, 200


async def test_mixed_priorities_against_a_saturated_engine(
    spawn, start_sim, start_gateway, openai_client, http
) -> None:
    sim = await start_sim(model=MODEL, max_num_seqs=2, time_scale=4.0)
    gw = await start_gateway(
        [sim.url],
        policy="round-robin",
        health={"interval_s": 0.1, "timeout_s": 0.5},
        scrape={"interval_s": 0.1, "timeout_s": 0.5},
        admission={"queue_timeout_s": 6},
    )
    client = openai_client(gw)
    name = sim.url.split("://", 1)[1]

    # Wave 1: 14 long standard requests (200 tokens ≈ 0.3 s each, 2 at a time) fill the engine.
    wave1 = [spawn(_send(client, "standard", i, 200)) for i in range(14)]

    async def saturated() -> bool:
        text = await gateway_metrics(http, gw)
        return metric_value(text, "llm_gateway_endpoint_saturated", endpoint=name) == 1

    await wait_until(saturated, 5.0, "the simulator's deep engine queue to saturate the pool")

    # Wave 2, while the engine queue is deep: sheddable shed, critical served, standard queued.
    wave2 = [spawn(_send(client, "sheddable", i, 16)) for i in range(5)]
    wave2 += [spawn(_send(client, "critical", i, 16)) for i in range(3)]
    wave2 += [spawn(_send(client, "standard", 100 + i, 16)) for i in range(4)]
    results = await asyncio.gather(*wave1, *wave2)

    sent = len(wave1) + len(wave2)
    assert len(results) == sent
    by_class = Counter(results)
    assert by_class[("sheddable", 429)] == 5, by_class
    assert by_class[("critical", 200)] == 3, by_class
    assert by_class[("standard", 200)] == 14 + 4, by_class  # queued, then admitted as the queue drained
    ok = sum(n for (_, status), n in by_class.items() if status == 200)
    shed = sum(n for (_, status), n in by_class.items() if status == 429)
    assert ok + shed == sent

    # Exactly one engine request per 200, none for a 429, none aborted.
    state = sim.engine.state()
    assert sum(state["finished"].values()) == ok, state["finished"]
    assert state["finished"].get("abort", 0) == 0
    assert await metric(http, gw, "llm_gateway_admission_decisions_total", outcome="shed") == shed
    assert (
        await metric(
            http,
            gw,
            "llm_gateway_admission_decisions_total",
            priority="standard",
            outcome="admitted",
            reason="dequeued",
        )
        >= 4
    )
    assert await metric(http, gw, "llm_gateway_admission_queue_length", priority="standard") == 0
