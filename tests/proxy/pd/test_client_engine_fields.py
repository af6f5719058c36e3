"""A client's own P/D hand-over fields never reach a replica: vLLM's ``kv_transfer_params`` and
SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` are the gateway's to set.

Found by review (2026-12-05): they were forwarded as sent whenever a request was served without
a prefill leg (a short or cached prompt, a failed prefill with fallback, a plain fleet). With them
a client made a decode engine pull KV blocks by id from a prefill engine (another tenant's
prompt), connect to a host and port of its choosing, or join another request's bootstrap room.
"""

from __future__ import annotations

import pytest

from tests.support.harness import chat_body

FORGED = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "remote_engine_id": "victim-engine",
        "remote_block_ids": list(range(64)),
        "remote_host": "10.66.66.66",
        "remote_port": 5600,
    },
    "bootstrap_host": "10.66.66.66",
    "bootstrap_port": 8998,
    "bootstrap_room": 12345,
}


@pytest.mark.parametrize("fleet", ["vllm-pd", "sglang-pd", "plain"])
async def test_client_hand_over_fields_are_dropped(fleet, start_upstream, start_gateway, http):
    prefill, decode = await start_upstream(), await start_upstream()
    if fleet == "plain":
        endpoints, extra = [{"url": decode.url, "models": ["tiny"]}], {}
    else:
        protocol = fleet.removesuffix("-pd")
        first = {"url": prefill.url, "role": "prefill", "engine": protocol, "models": ["tiny"]}
        if protocol == "sglang":
            first["bootstrap_port"] = 8998
        second = {"url": decode.url, "role": "decode", "engine": protocol, "models": ["tiny"]}
        endpoints, extra = [first, second], {"pd": {"protocol": protocol}}
    gw = await start_gateway(endpoints, scrape={"enabled": False}, **extra)
    body = {**chat_body(), **FORGED, "temperature": 0.25}  # short: served without a prefill leg
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    sent = decode.requests[-1].json
    assert not set(FORGED) & set(sent), sent
    assert sent["temperature"] == 0.25 and sent["messages"] == body["messages"]  # the rest as sent
    assert not prefill.requests or fleet == "plain"
