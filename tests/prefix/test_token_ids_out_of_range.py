"""A token-id prompt with an id no engine has (past uint32) is the engine's 400 to answer, never
a 500 from the exact index's block hashing (found by review, 2026-12-05: ``struct.error``
escaped routing once a replica's KV-event stream was live)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from loadtest.harness.kv_replayer import ThreadedPublisher
from tests.support.harness import running_gateway

B = 16


async def test_a_token_id_past_uint32_reaches_the_replica_not_a_500(start_upstream, http) -> None:
    upstream = await start_upstream()
    publisher = ThreadedPublisher()
    endpoint = {
        "url": upstream.url,
        "kv_events": {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint},
    }
    prefix = {"exact": "auto", "kv_events": {"discover": False}}
    try:
        async with running_gateway([endpoint], prefix=prefix) as gw:
            index = gw.state.prefix.exact.index
            async with asyncio.timeout(10):
                while not index.live(upstream.name):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                while index.size(upstream.name) != 1:  # the block size is known from a stored block
                    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                              "token_ids": list(range(B)), "block_size": B, "medium": "GPU"}  # fmt: skip
                    publisher.send(msgspec.msgpack.encode([time.time(), [stored], None]))
                    await asyncio.sleep(0.1)
            # past uint32 or negative: the replica's to refuse; past int64: the gateway's own 400
            for bad, status in ((2**32, 200), (2**63 - 1, 200), (-1, 200), (2**64, 400)):
                prompt = [7] * (2 * B)
                prompt[3] = bad
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
                async with http.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == status, (bad, await resp.text())
                    if status == 400:
                        assert (await resp.json())["error"]["param"] == "prompt"
                if status == 200:  # the fake replica's answer
                    assert upstream.requests[-1].json["prompt"][3] == bad
            async with http.post(gw.url + "/v1/completions", json={**body, "prompt": [7] * (2 * B)}) as resp:
                assert resp.status == 200
    finally:
        with contextlib.suppress(Exception):
            publisher.close()
