"""``--workers 2`` with auth on and the memory store: a response made through one worker is
its tenant's through the other too (the workers broadcast their response records; with auth
on the replicas are never probed for an unknown id), a delete through one is seen by both, and
a worker started again after a death knows what was made before it started."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import yaml

from gateway.auth import hash_key
from tests.support.responses_replica import running_replica
from tests.support.workers import by_worker, spawn_gateway, worker_pids
from tests.web.workers.test_respawn import _new_worker, _session_on

KEY_A, KEY_B = "sk-workers-a", "sk-workers-b"
HI = {"model": "tiny", "input": "hi"}


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _gateway(replica: str, tmp_path: Path):
    """``serve --workers 2``, auth on (tenants ``a``, ``b``: ``KEY_A``, ``KEY_B``), the memory stores."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "tenants": {"a": {}, "b": {}},
                "keys": [
                    {"sha256": hash_key(KEY_A), "tenant": "a"},
                    {"sha256": hash_key(KEY_B), "tenant": "b"},
                ],
            }
        )
    )
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump({"auth": {"enabled": True, "keys_file": str(keys)}}))
    return await spawn_gateway([replica], ["--workers", "2", "--config", str(config)], tmp_path)


async def _create(session, url: str) -> str:
    async with session.post(url + "/v1/responses", json=HI, headers=_headers(KEY_A)) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["id"]


async def _status(session, method: str, url: str, key: str) -> int:
    async with session.request(method, url, headers=_headers(key)) as resp:
        return resp.status


async def test_a_response_made_through_one_worker_is_found_through_the_other(stack, tmp_path):
    replica = await stack.enter_async_context(running_replica())
    gw = await _gateway(replica.url, tmp_path)
    try:
        async with by_worker(gw.url) as found:
            first, second = (sessions[0] for sessions in found.values())
            response_id = await _create(first, gw.url)
            url = f"{gw.url}/v1/responses/{response_id}"
            for _ in range(50):  # the sibling's copy arrives by datagram, off the request's path
                if await _status(second, "GET", url, KEY_A) == 200:
                    break
                await asyncio.sleep(0.02)
            assert await _status(second, "GET", url, KEY_A) == 200, gw.log_tail(3000)
            assert await _status(second, "GET", url, KEY_B) == 404  # still tenant a's only
            async with second.post(
                gw.url + "/v1/responses",
                json={"model": "tiny", "input": "more", "previous_response_id": response_id},
                headers=_headers(KEY_A),
            ) as resp:
                assert resp.status == 200, await resp.text()

            assert await _status(second, "DELETE", url, KEY_A) == 200
            for _ in range(50):
                if await _status(first, "GET", url, KEY_A) == 404:
                    break
                await asyncio.sleep(0.02)
            assert await _status(first, "GET", url, KEY_A) == 404  # the delete reached the first
    finally:
        await gw.stop()


async def test_a_worker_started_again_knows_the_responses_made_before_it_started(stack, tmp_path):
    """Without the catch-up, the replacement answered 404 to every chain made before it started,
    on every connection the kernel gave it."""
    replica = await stack.enter_async_context(running_replica())
    gw = await _gateway(replica.url, tmp_path)
    try:
        made = []
        async with by_worker(gw.url) as found:
            for sessions in found.values():  # through both workers
                for _ in range(3):
                    made.append(await _create(sessions[0], gw.url))
            deleted = made.pop()
            survivor = next(iter(found.values()))[0]
            assert await _status(survivor, "DELETE", f"{gw.url}/v1/responses/{deleted}", KEY_A) == 200
            old = worker_pids(gw.pid)
        victim = min(old)
        os.kill(victim, signal.SIGKILL)
        fresh = await _new_worker(gw, old)
        async with _session_on(gw.url, fresh) as session:
            for _ in range(100):  # the catch-up runs after it listens
                statuses = [await _status(session, "GET", f"{gw.url}/v1/responses/{r}", KEY_A) for r in made]
                if statuses == [200] * len(made):
                    break
                await asyncio.sleep(0.05)
            assert statuses == [200] * len(made), (statuses, gw.log_tail(3000))
            assert await _status(session, "GET", f"{gw.url}/v1/responses/{made[0]}", KEY_B) == 404
            assert await _status(session, "GET", f"{gw.url}/v1/responses/{deleted}", KEY_A) == 404
            async with session.post(
                gw.url + "/v1/responses",
                json={"model": "tiny", "input": "more", "previous_response_id": made[0]},
                headers=_headers(KEY_A),
            ) as resp:
                assert resp.status == 200, await resp.text()
        assert "caught up from worker" in gw.log_tail(5000)
    finally:
        await gw.stop()
