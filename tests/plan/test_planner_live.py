"""``llm-gateway plan --live URL`` against a real gateway in front of real simulators."""

from __future__ import annotations

import asyncio
import json
import sys

from tests.support.harness import wait_until


async def _plan_live(url: str, *extra: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "plan", "--live", url, *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode or 0, out.decode(), err.decode()


async def test_live_plan_reports_pools_and_in_flight_load(start_sim, start_gateway, http) -> None:
    # One batch slot each and ~6 s per answer: the load stays put while the CLI reads it.
    sims = [await start_sim(max_num_seqs=1, time_scale=1) for _ in range(2)]
    gw = await start_gateway([s.url for s in sims], scrape={"interval_s": 0.1}, admission={"enabled": False})
    model = sims[0].config.model

    async def one(i: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": f"live {i}"}], "max_tokens": 1000}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()

    load = [asyncio.create_task(one(i)) for i in range(10)]
    try:

        async def queued() -> bool:
            return sum(e.in_flight for e in gw.state.registry) == 10 and any(
                (e.metrics.waiting or 0) > 0 for e in gw.state.registry
            )

        await wait_until(queued, within_s=5, what="requests in flight and queued")
        rc, out, err = await _plan_live(gw.url, "--json")
        assert rc == 0, err
        report = json.loads(out)
        assert report["in_flight"] == 10
        (pool,) = report["pools"]
        assert pool["pool"] == "both" and pool["replicas"] == 2
        assert pool["queue_depth"] > 0 and pool["desired_replicas"] > 2
        rc, text, _ = await _plan_live(gw.url)
        assert rc == 0 and "the observed load needs" in text
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)


async def test_live_plan_against_nothing_is_a_clear_error() -> None:
    rc, _, err = await _plan_live("http://127.0.0.1:9")
    assert rc == 2 and "cannot size from http://127.0.0.1:9" in err
