"""A prefill replica that keeps failing is ejected by its circuit breaker, like a decode one,
within its own pool's ejection allowance; and a prefill pool with no replica left is decode-only.

Before: a prefill leg reported no verdict, so the breaker of a broken prefill replica never
opened and the pool kept trying it (each request paid a failed leg before the next replica).
Then (found by review of that fix): the allowance was counted over prefill and decode replicas
together, so a broken pool could be ejected whole, and a prefill profile with no candidate
failed every request with 503 although ``fallback_to_decode`` was on.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.proxy.hostile.common import errors, healthy_after, post, raw
from tests.proxy.hostile.raw import response
from tests.proxy.hostile.test_pd_adversarial import pd_gateway, prefill_ok
from tests.proxy.hostile.test_wire_nonsense import good
from tests.proxy.pd.helpers import gw_metric
from tests.support.harness import wait_until


async def _counting(seen: list[int], script):
    async def counted(i, reader, writer, body):
        seen.append(i)
        return await script(i, reader, writer, body)

    return counted


async def _failing(i, reader, writer, body):
    writer.write(response(b'{"error": {"message": "prefill dead", "type": "x"}}', "503 Service Unavailable"))
    return True


async def test_a_failing_prefill_replica_is_ejected_and_left_alone(stack, start_gateway, http, caplog):
    broken_seen: list[int] = []
    broken = await raw(stack, await _counting(broken_seen, _failing))
    working = await raw(stack, prefill_ok)
    decode = await raw(stack, good)
    gw = await pd_gateway(
        start_gateway,
        [broken, working],
        [decode],
        resilience={"retry_backoff_s": 0, "consecutive_failures": 2, "ejection_s": 60, "max_ejection_s": 60},
    )
    endpoint = next(e for e in gw.state.registry if e.url == broken.url)
    for n in range(40):  # ties between the two prefill replicas go either way: it is tried soon
        status, body, _ = await post(http, gw, messages=[{"role": "user", "content": f"question {n}"}])
        assert status == 200, body
        if endpoint.ejected:
            break
    assert endpoint.ejected, f"the broken prefill replica was tried {len(broken_seen)} times, never ejected"
    tried = len(broken_seen)
    for n in range(10):
        status, body, _ = await post(http, gw, messages=[{"role": "user", "content": f"after {n}"}])
        assert status == 200, body
    assert len(broken_seen) == tried, "an ejected prefill replica was still sent prefill legs"
    await asyncio.sleep(0)
    await healthy_after(http, gw)
    assert not errors(caplog)


_BREAKER = {"retry_backoff_s": 0, "consecutive_failures": 2, "ejection_s": 60, "max_ejection_s": 60}


async def test_the_only_prefill_replica_is_never_ejected_and_requests_go_decode_only(
    stack, start_gateway, http
):
    dead = await raw(stack, _failing)
    decode = await raw(stack, good)
    gw = await pd_gateway(start_gateway, [dead], [decode], resilience=_BREAKER)
    for n in range(6):
        status, body, _ = await post(http, gw, messages=[{"role": "user", "content": f"q {n}"}])
        assert status == 200, body  # the failed leg, then decode-only (fallback_to_decode)
    assert not next(e for e in gw.state.registry if e.url == dead.url).ejected


async def test_a_prefill_pool_outage_never_ejects_the_whole_pool(stack, start_gateway, http):
    state = {"broken": True}

    async def switchable(i, reader, writer, body):
        return await (_failing if state["broken"] else prefill_ok)(i, reader, writer, body)

    prefills = [await raw(stack, switchable) for _ in range(2)]
    decodes = [await raw(stack, good) for _ in range(2)]
    gw = await pd_gateway(start_gateway, prefills, decodes, resilience=_BREAKER)
    for n in range(8):
        status, body, _ = await post(http, gw, messages=[{"role": "user", "content": f"outage {n}"}])
        assert status == 200, body
    urls = {p.url for p in prefills}
    ejected = [e.name for e in gw.state.registry if e.url in urls and e.ejected]
    assert len(ejected) == 1, ejected  # max_ejected_fraction 0.5 of a pool of two
    state["broken"] = False
    status, body, _ = await post(http, gw, messages=[{"role": "user", "content": "after"}])
    assert status == 200, body
    assert await gw_metric(http, gw, "llm_gateway_pd_decisions_total", mode="disaggregated", reason="always")


@pytest.mark.parametrize("fallback", [True, False])
async def test_no_prefill_replica_left_is_decode_only_unless_fallback_is_off(
    fallback, stack, start_gateway, http
):
    prefill = await raw(stack, prefill_ok)
    decode = await raw(stack, good)
    gw = await pd_gateway(
        start_gateway,
        [prefill],
        [decode],
        pd={"fallback_to_decode": fallback},
        health={"interval_s": 0.05, "timeout_s": 0.5, "unhealthy_threshold": 1},
    )
    endpoint = next(e for e in gw.state.registry if e.url == prefill.url)
    await prefill.stop()  # the whole prefill pool is gone: its health checks fail

    async def down() -> bool:
        return not endpoint.healthy

    await wait_until(down, 5.0, "the prefill replica to be marked down")
    status, body, _ = await post(http, gw)
    if fallback:
        assert status == 200, body
        count = await gw_metric(
            http, gw, "llm_gateway_pd_decisions_total", mode="decode_only", reason="no_prefill_replica"
        )
        assert count == 1
    else:
        assert status == 503, body
        assert b"prefill-pool" in body
