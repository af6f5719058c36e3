"""With auth on: ``/debug/endpoints`` needs the admin key, and the client's body ``priority`` reaches
the engine only without auth.

Each test reproduces a reviewer's finding over real sockets."""

from __future__ import annotations

from tests.support.edge_cases import ADMIN, ADMIN_SHA, TENANT_KEY, keys_yaml, post_chat
from tests.support.harness import chat_body

# ---- /debug/endpoints with auth on -----------------------------------------------------------


async def test_debug_endpoints_needs_the_admin_key_when_auth_is_on(
    start_upstream, start_gateway, http, tmp_path
):
    a = await start_upstream()
    keys = keys_yaml(tmp_path / "keys.yaml")
    gw = await start_gateway(
        [a.url], auth={"enabled": True, "keys_file": keys, "admin_key_sha256": ADMIN_SHA}
    )
    url = gw.url + "/debug/endpoints"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {TENANT_KEY}"}):
        async with http.get(url, headers=headers) as resp:
            assert resp.status == 401  # old: 200 with the fleet's internals
    async with http.get(url, headers=ADMIN) as resp:
        assert resp.status == 200
        assert [r["url"] for r in (await resp.json())["endpoints"]] == [a.url]

    closed = await start_gateway([a.url], auth={"enabled": True, "keys_file": keys})
    async with http.get(closed.url + "/debug/endpoints", headers=ADMIN) as resp:
        assert resp.status == 404  # no admin key configured: not there at all

    open_gw = await start_gateway([a.url])  # auth off (the demo): unchanged
    async with http.get(open_gw.url + "/debug/endpoints") as resp:
        assert resp.status == 200


# ---- the body's "priority" with auth on ----------------------------------------------------


async def test_clients_body_priority_reaches_the_engine_only_without_auth(
    start_upstream, start_gateway, http, tmp_path
):
    a = await start_upstream()
    keys = keys_yaml(tmp_path / "keys.yaml", priority="standard")
    auth = {"authorization": f"Bearer {TENANT_KEY}"}

    gw = await start_gateway([a.url], auth={"enabled": True, "keys_file": keys})
    assert (await post_chat(http, gw, headers=auth, priority=-100))[0] == 200
    sent = a.requests[-1].json
    assert "priority" not in sent  # old: -100, ahead of every other tenant in the engine
    assert sent["messages"] == chat_body()["messages"] and sent["max_tokens"] == 4

    ranked = await start_gateway(
        [a.url],
        auth={"enabled": True, "keys_file": keys},
        admission={"engine_priority": {"critical": 1, "standard": 5, "sheddable": 9}},
    )
    assert (await post_chat(http, ranked, headers=auth, priority=-100))[0] == 200
    assert a.requests[-1].json["priority"] == 5  # the tenant's class, not what it asked for

    open_gw = await start_gateway([a.url])
    assert (await post_chat(http, open_gw, priority=-100))[0] == 200
    assert a.requests[-1].json["priority"] == -100  # no tenants to protect: passed through
