"""``server.access_log: json``: one JSON line per request, with who served it and why."""

from __future__ import annotations

import json
import logging

import pytest


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "llm_gateway.access"]


async def test_one_json_line_per_request(start_sim, start_gateway, http, caplog) -> None:
    sim = await start_sim()
    gw = await start_gateway([sim.url], server={"access_log": "json"})
    model = sim.config.model
    caplog.set_level(logging.INFO, logger="llm_gateway.access")
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "stream": True,
    }
    async with http.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"x-request-id": "req-42", "x-priority": "critical"},
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.post(gw.url + "/v1/chat/completions", json={"model": "nope", "messages": []}) as resp:
        assert resp.status == 400
    first, second = _lines(caplog)
    assert first["id"] == "req-42" and first["status"] == 200 and first["model"] == model
    assert first["priority"] == "critical" and first["endpoint"] == sim.url.split("://")[1]
    assert first["ttft_ms"] > 0 and first["duration_ms"] >= first["ttft_ms"]
    assert first["route"]["profile"] == "default" and "score" in first["route"]
    assert second["status"] == 400 and second["path"] == "/v1/chat/completions" and "endpoint" not in second


async def test_off_by_default(start_sim, start_gateway, http, caplog) -> None:
    sim = await start_sim()
    gw = await start_gateway([sim.url])
    caplog.set_level(logging.INFO, logger="llm_gateway.access")
    async with http.get(gw.url + "/v1/models") as resp:
        assert resp.status == 200
    assert _lines(caplog) == []
