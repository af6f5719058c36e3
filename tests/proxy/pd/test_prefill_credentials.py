"""A P/D prefill leg carries the prefill endpoint's own credentials, like every other request to it.

Regression: the prefill request was sent with only ``x-request-id``, so a prefill replica
started with ``--api-key`` answered 401 and every request silently fell back to decode-only.
"""

from __future__ import annotations

from tests.support.harness import chat_body


async def test_the_prefill_leg_sends_the_prefill_endpoints_api_key(start_upstream, start_gateway, http):
    prefill = await start_upstream()
    decode = await start_upstream()
    gw = await start_gateway(
        [
            {"url": prefill.url, "role": "prefill", "api_key": "sk-prefill"},
            {"url": decode.url, "role": "decode", "api_key": "sk-decode"},
        ],
        pd={"decider": "always"},
    )
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 200
    legs = [r for r in prefill.requests if r.path == "/v1/chat/completions"]
    assert legs, "no prefill leg was sent"
    assert legs[0].headers["authorization"] == "Bearer sk-prefill"
    assert legs[0].json["max_tokens"] == 1 and "kv_transfer_params" in legs[0].json
    served = [r for r in decode.requests if r.path == "/v1/chat/completions"]
    assert served and served[0].headers["authorization"] == "Bearer sk-decode"
