"""A prefill replica that keeps failing is ejected by its circuit breaker, like a decode one.

Before: a prefill leg reported no verdict, so the breaker of a broken prefill replica never
opened and the pool kept trying it (each request paid a failed leg before the next replica).
"""

from __future__ import annotations

import asyncio

from tests.proxy.hostile.common import errors, healthy_after, post, raw
from tests.proxy.hostile.raw import response
from tests.proxy.hostile.test_pd_adversarial import pd_gateway, prefill_ok
from tests.proxy.hostile.test_wire_nonsense import good


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
