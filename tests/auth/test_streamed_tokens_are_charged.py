"""Tokens-per-minute limits charge what was streamed, on every outcome.

Regression: a tenant with 1,000 TPM streamed ``max_tokens: 400`` and closed the socket
after 395 tokens; the gateway took the disconnect for a failure and refunded the whole
up-front charge, so the quota never moved (6 of 6 such requests succeeded).
"""

from __future__ import annotations

import aiohttp
import yaml

from gateway.auth import hash_key

KEY = "sk-streamer"
MODEL = "sim-llama"


async def _stream_then_hang_up(http: aiohttp.ClientSession, url: str, after_events: int) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to four hundred"}],
        "max_tokens": 400,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY}"}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            await resp.read()
            return resp.status
        events = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                events += 1
                if events >= after_events:
                    resp.close()  # the client vanishes before the end (and before any usage)
                    break
        assert events >= after_events
        return 200


async def test_a_client_that_hangs_up_late_is_charged_for_what_it_got(
    start_sim, start_gateway, http, tmp_path
):
    sim = await start_sim(model=MODEL, time_scale=4.0)
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "tenants": {"t": {"tokens_per_minute": 1000}},
                "keys": [{"sha256": hash_key(KEY), "tenant": "t"}],
            }
        )
    )
    gw = await start_gateway([sim.url], auth={"enabled": True, "keys_file": str(keys)})
    statuses = [await _stream_then_hang_up(http, gw.url, after_events=395) for _ in range(6)]
    # ~400 tokens were served each time: the third request no longer fits 1,000 a minute.
    assert statuses[:2] == [200, 200], statuses
    assert 429 in statuses[2:], statuses
