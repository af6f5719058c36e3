"""Tokens charged up front are refunded when the request fails before any engine did work for it.

Each test reproduces a reviewer's finding over real sockets."""

from __future__ import annotations

from tests.support.edge_cases import TENANT_KEY, keys_yaml, post_chat

# ---- r8: tokens charged up front are refunded on failure ---------------------------------


async def test_failed_requests_refund_their_token_charge(start_upstream, start_gateway, http, tmp_path):
    a = await start_upstream()
    a.mode, a.status = "status", 500
    keys = keys_yaml(tmp_path / "keys.yaml", tokens_per_minute=1000)
    gw = await start_gateway([a.url], auth={"enabled": True, "keys_file": keys})
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    for _ in range(3):  # each charges ~400 tokens up front; three would exceed 1000
        assert (await post_chat(http, gw, headers=auth, max_tokens=400))[0] == 500
    a.mode = "ok"  # recovered; the tenant has used no tokens at all
    assert (await post_chat(http, gw, headers=auth, max_tokens=400))[0] == 200  # old: 429
