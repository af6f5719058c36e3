"""A replica stopped mid-run: its traffic moves to the other one and no waiting client sees an error.

Non-streaming requests have not started streaming until they are complete, so every
one of them must succeed. vLLM 0.32 (default ``--shutdown-timeout 0``) on SIGTERM
refuses new connections at once and aborts what it was serving: an in-flight request
either hangs open and silent until its client gives up, gets a 500, or gets a 200 whose
``finish_reason`` is ``"abort"``. The gateway must re-send every one of them to the
survivor; a 200-abort passed on to the client counts as a failure here.

Sorted last in this directory on purpose: the next test that wants the fleet waits
for the stopped replica to restart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e_vllm.conftest import Fleet
from tests.e2e_vllm.helpers import MODEL
from tests.support.harness import debug_endpoints, gateway_metrics, wait_until

pytestmark = pytest.mark.slow
WORKERS = 4
BEFORE_S = 3.0
AFTER_S = 6.0


@dataclass
class Outcome:
    sent_at: float
    status: int
    served: str | None
    error: str | None = None


def _error(status: int, payload: dict) -> str | None:
    if status != 200:
        return f"{status}: {str(payload)[:300]}"
    finish = payload["choices"][0]["finish_reason"]
    if finish == "abort":  # vLLM aborts in-flight requests on SIGTERM and still answers 200
        return f"200 with finish_reason=abort after {payload['usage']['completion_tokens']} tokens"
    if payload["usage"]["completion_tokens"] != 24:
        return f"200 with {payload['usage']['completion_tokens']} tokens, finish_reason={finish}"
    return None


async def _worker(http: aiohttp.ClientSession, url: str, n: int, stop_at: float, out: list[Outcome]) -> None:
    i = 0
    while time.monotonic() < stop_at:
        i += 1
        prompt = f"worker {n} request {i} " * 8
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "ignore_eos": True}
        sent = time.monotonic()
        try:
            async with http.post(url + "/v1/completions", json=body) as resp:
                payload = await resp.json(content_type=None)
                served = resp.headers.get("x-gateway-endpoint")
                out.append(Outcome(sent, resp.status, served, _error(resp.status, payload)))
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.append(Outcome(sent, 0, None, repr(exc)))


async def test_stopping_a_replica_moves_traffic_without_failing_requests(
    fleet: Fleet, start_gateway, http
) -> None:
    gw = await start_gateway(fleet.urls, policy="round-robin")
    victim, survivor = fleet.replicas[1], fleet.replicas[0]
    victim_name, survivor_name = victim.url.split("://")[1], survivor.url.split("://")[1]
    outcomes: list[Outcome] = []
    start = time.monotonic()
    stop_at = start + BEFORE_S + AFTER_S
    workers = [asyncio.create_task(_worker(http, gw.url, n, stop_at, outcomes)) for n in range(WORKERS)]
    await asyncio.sleep(BEFORE_S)
    served_before = {o.served for o in outcomes}
    killed_at = time.monotonic()
    victim.terminate()  # SIGTERM by PID: vLLM's graceful shutdown

    async def ejected() -> bool:
        return not (await debug_endpoints(http, gw))[victim.url]["healthy"]

    await wait_until(ejected, 5.0, "the gateway to mark the stopped replica unhealthy")
    await asyncio.gather(*workers)

    failures = [o for o in outcomes if o.error is not None]
    after = [o for o in outcomes if o.sent_at > killed_at + 1.0]
    retries = {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(await gateway_metrics(http, gw))
        for s in family.samples
        if s.name == "llm_gateway_retries_total"
    }
    print(
        f"\nrequests: {len(outcomes)} (failed {len(failures)}), sent >1 s after the stop: {len(after)}, "
        f"gateway retries by reason: {retries}, victim exit code: {victim.process.poll()}"
    )
    assert served_before == {victim_name, survivor_name}, "both replicas served before the stop"
    assert failures == [], failures[:5]
    assert len(after) >= 8
    assert {o.served for o in after} == {survivor_name}
