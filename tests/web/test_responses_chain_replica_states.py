"""A ``previous_response_id`` chain follows its replica's state, over real sockets (review findings).

- draining, and the only replica of the model: the chain continues there (a draining replica
  still holds its responses); it was a 503 "no healthy endpoint", retried by SDKs until the
  drain ended;
- gone before the health checks noticed: the documented 409 ``response_replica_unavailable``
  naming it, as ``GET`` answers; it was a 502 saying no replica of the model could be reached.
"""

from __future__ import annotations

import hashlib

from tests.support.harness import wait_until
from tests.support.responses_replica import running_replica

ADMIN_KEY = "admin-secret-chain"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


async def _create(http, gw, **extra) -> tuple[int, dict, str | None]:
    async with http.post(gw.url + "/v1/responses", json={"model": "tiny", "input": "hi", **extra}) as resp:
        return resp.status, await resp.json(), resp.headers.get("x-gateway-endpoint")


async def test_a_chain_continues_on_its_draining_replica_the_only_one_of_its_model(
    start_gateway, http
) -> None:
    async with running_replica() as replica:
        auth = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
        gw = await start_gateway([replica.url], auth=auth)
        await wait_until(lambda: _healthy(gw), 5.0, "the replica healthy")
        status, first, _ = await _create(http, gw)
        assert status == 200
        async with http.post(
            gw.url + "/admin/endpoints/drain", json={"url": replica.url}, headers=ADMIN
        ) as resp:
            assert resp.status == 200
        status, body, served = await _create(http, gw, previous_response_id=first["id"])
        assert (status, served) == (200, replica.name), body  # old: 503 no_healthy_endpoint
        status, body, _ = await _create(http, gw)  # a new conversation has nowhere to go
        assert status == 503 and body["error"]["code"] == "no_healthy_endpoint"


async def test_a_chain_whose_replica_does_not_answer_is_a_409_naming_it(start_gateway, http) -> None:
    async with running_replica() as other, running_replica() as holder:
        gw = await start_gateway([holder.url, other.url], policy="round-robin")
        await wait_until(lambda: _healthy(gw, 2), 5.0, "both replicas healthy")
        for _ in range(4):  # round-robin: one of these lands on the holder
            status, first, served = await _create(http, gw)
            if served == holder.name:
                break
        assert served == holder.name
        await holder.stop()  # gone before a probe notices
        sent_elsewhere = _posts(other)
        status, body, _ = await _create(http, gw, previous_response_id=first["id"])
        assert status == 409, body  # old: 502 upstream_unavailable, "no endpoint could be reached"
        assert body["error"]["code"] == "response_replica_unavailable"
        assert holder.name in body["error"]["message"]
        assert _posts(other) == sent_elsewhere  # the chain is nowhere else


def _posts(replica) -> int:
    return sum(1 for method, path, _ in replica.seen if method == "POST" and path == "/v1/responses")


async def _healthy(gw, count: int = 1) -> bool:
    endpoints = list(gw.state.registry)
    return len(endpoints) == count and all(e.healthy and e.models for e in endpoints)
