"""A step burst from an idle fleet: 150 requests at once on two replicas with 2 batch slots.

Regression: the saturation detector counted requests sent since the last scrape only if
the engine was already queueing at that scrape, so a burst from idle was admitted in
full (150 of 150) and queued inside the engines until the next scrape. Now the gateway
counts its own in-flight work beyond each replica's batch capacity as queued at once:
sheddable work is refused from the start of the burst, critical work is all served,
and every request gets exactly one answer.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import openai

from tests.support.harness import wait_until

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
