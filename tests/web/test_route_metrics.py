"""Per-route answers (the gateway's own 401/404/429/503 included) and stored-response lookups,
read from a real gateway's /metrics over real simulators."""

from __future__ import annotations

import openai
import pytest

from tests.deploy.live_fleet import KEY_OK, KEY_TINY, write_keys
from tests.support.harness import gateway_metrics, metric_value

SIM = "sim-llama"


def _count(text: str, route: str, status: int) -> float:
    return metric_value(text, "llm_gateway_http_requests_total", route=route, status=str(status)) or 0.0


async def test_every_answer_counted_by_route_pattern(start_sim, start_gateway, http, openai_client):
    sim = await start_sim()
    gw = await start_gateway([sim.url])
    client = openai_client(gw)
    first = await client.responses.create(model=SIM, input="hi", max_output_tokens=2)
    await client.responses.create(model=SIM, input="on", max_output_tokens=2, previous_response_id=first.id)
    await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_missing")
    async with http.post(gw.url + "/v1/messages", json={"model": SIM, "max_tokens": 2,
                         "messages": [{"role": "user", "content": "hi"}]}) as resp:  # fmt: skip
        assert resp.status == 200
    async with http.get(gw.url + "/v1/no/such/path/abc123") as resp:
        assert resp.status == 404
    async with http.post(gw.url + "/v1/chat/completions", json={"model": "nobody-serves-it"}) as resp:
        assert resp.status in (400, 404)
    text = await gateway_metrics(http, gw)
    assert _count(text, "/v1/responses", 200) == 2
    assert _count(text, "/v1/responses/{response_id}", 200) == 1
    assert _count(text, "/v1/responses/{response_id}", 404) == 1
    assert _count(text, "/v1/messages", 200) == 1
    assert _count(text, "unmatched", 404) == 1
    assert "abc123" not in text  # never the raw path
    lookups = {r: metric_value(text, "llm_gateway_response_lookups_total", result=r) for r in
               ("hit", "probed", "not_found", "replica_unavailable")}  # fmt: skip
    # previous_response_id + retrieve: two hits; the missing id asked the replica, then not found
    assert lookups == {"hit": 2.0, "probed": 0.0, "not_found": 1.0, "replica_unavailable": 0.0}
    count = metric_value(text, "llm_gateway_http_request_duration_seconds_count", route="/v1/responses")
    assert count == 2


async def test_the_gateways_own_refusals_are_counted(start_sim, start_gateway, http, tmp_path):
    sim = await start_sim()
    keys = write_keys(tmp_path / "keys.yaml")
    gw = await start_gateway([sim.url], auth={"enabled": True, "backend": "file", "keys_file": str(keys)})
    body = {"model": SIM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key, expected in (("sk-wrong", 401), (KEY_TINY, 200), (KEY_TINY, 429), (KEY_OK, 200)):
        async with http.post(
            gw.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as resp:
            assert resp.status == expected, await resp.text()
    text = await gateway_metrics(http, gw)
    route = "/v1/chat/completions"
    assert (_count(text, route, 401), _count(text, route, 429), _count(text, route, 200)) == (1, 1, 2)
    # The proxy's own counter never saw the refusals: only the two answers a replica gave.
    assert metric_value(text, "llm_gateway_requests_total") == 2
