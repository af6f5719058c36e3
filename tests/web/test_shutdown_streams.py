"""A stream still running when ``server.shutdown_timeout_s`` runs out ends cleanly.

Real ``llm-gateway serve`` process, a real-time simulator (10 ms per token) and SIGTERM:
the stream outlives drain + shutdown timeout, and must end with an SSE error event and
``data: [DONE]`` — not a connection cut mid-body (curl exit 18) — and the process exits.
"""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import yaml

from loadtest.fleet import start_gateway


async def _stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[int, str]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a very long story"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, (await resp.read()).decode()  # raises if the body is cut short


async def test_a_stream_past_the_shutdown_timeout_ends_with_an_error_event_and_done(start_sim, tmp_path):
    sim = await start_sim(model="m", time_scale=1.0, decode_step_ms=10.0)
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump({"server": {"drain_s": 0.3, "shutdown_timeout_s": 1.0}}))
    gw = await start_gateway([sim.url], ["--config", str(config)], log_dir=tmp_path)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            streams = [asyncio.create_task(_stream(http, gw.url, 2000)) for _ in range(2)]  # ≈20 s each
            await asyncio.sleep(0.5)
            gw.process.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*streams)
        for status, text in results:
            assert status == 200
            assert text.endswith("data: [DONE]\n\n"), text[-300:]
            events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "gateway_shutting_down"
            assert "shutting down" in error["message"]
            assert len(events) > 10  # tokens did stream before the cut
        assert await asyncio.wait_for(gw.process.wait(), 5) == 0
        assert "Traceback" not in gw.log_tail(20000)
    finally:
        await gw.stop()
