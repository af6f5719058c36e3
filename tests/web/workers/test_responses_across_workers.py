"""``--workers 2`` with auth on and the memory store: a response made through one worker is
its tenant's through the other too (the workers broadcast their response records; with auth
on the replicas are never probed for an unknown id), and a delete through one is seen by both."""

from __future__ import annotations

import asyncio

import yaml

from gateway.auth import hash_key
from tests.support.responses_replica import running_replica
from tests.support.workers import by_worker, spawn_gateway

KEY_A, KEY_B = "sk-workers-a", "sk-workers-b"


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _status(session, method: str, url: str, key: str) -> int:
    async with session.request(method, url, headers=_headers(key)) as resp:
        return resp.status


async def test_a_response_made_through_one_worker_is_found_through_the_other(stack, tmp_path):
    replica = await stack.enter_async_context(running_replica())
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
    gw = await spawn_gateway([replica.url], ["--workers", "2", "--config", str(config)], tmp_path)
    try:
        async with by_worker(gw.url) as found:
            first, second = (sessions[0] for sessions in found.values())
            async with first.post(
                gw.url + "/v1/responses", json={"model": "tiny", "input": "hi"}, headers=_headers(KEY_A)
            ) as resp:
                assert resp.status == 200, await resp.text()
                response_id = (await resp.json())["id"]
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
