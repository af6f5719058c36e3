"""Large prompts: hashing stops at ``prefix.max_prompt_blocks`` and a long prompt is hashed off the loop.

Regression: a 15 MB prompt stalled the event loop for 458 ms under ``prefix-aware``
(90 ms with ``least-load``): every byte was hashed on the loop, though no engine caches
a prefix longer than its context.
"""

from __future__ import annotations

import asyncio
import threading

from gateway.prefix.chain_cache import HashChainCache
from gateway.prefix.hashing import block_hashes
from tests.support.harness import running_gateway


def test_the_cap_keeps_exactly_the_leading_blocks() -> None:
    prompt = "é" * 5000 + "x" * 5000  # multi-byte characters first: the cut is in bytes
    full = block_hashes("m", prompt, 64)
    assert block_hashes("m", prompt, 64, max_blocks=10) == full[:10]
    assert block_hashes("m", prompt, 64, max_blocks=10_000) == full


async def test_a_huge_prompt_is_served_and_indexed_only_up_to_the_cap(start_sim, stack, http, monkeypatch):
    threads: list[str] = []
    real = HashChainCache.block_hashes

    def recording(*args, **kwargs):  # the real hasher; notes which thread it ran on
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(HashChainCache, "block_hashes", recording)
    sim = await start_sim(model="m", max_model_len=10_000_000, kv_blocks=1_000_000)
    gw = await stack.enter_async_context(
        running_gateway([sim.url], policy="prefix-aware", prefix={"max_prompt_blocks": 2000})
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "z" * 3_000_000}], "max_tokens": 1}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        assert resp.status == 200
    endpoint = next(iter(gw.state.registry))
    assert gw.state.prefix.size(endpoint) == 2000
    assert threads and threads[0] != threading.main_thread().name  # hashed in a worker thread
    await asyncio.sleep(0)
