"""``/admin/endpoints``: closed by default, keyed, and live changes that never drop in-flight work."""

from __future__ import annotations

import asyncio
import hashlib

from tests.support.harness import chat_body, debug_endpoints, wait_until

ADMIN_KEY = "admin-secret-1"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
AUTH = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}


async def test_admin_api_is_closed_without_a_configured_key(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url])
    async with http.get(gw.url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
    async with http.post(gw.url + "/admin/endpoints", json={"url": "http://127.0.0.1:9"}) as resp:
        assert resp.status == 404
    assert len(gw.state.registry) == 1


async def test_wrong_or_missing_admin_key_is_401(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth=AUTH)
    for headers in ({}, {"authorization": "Bearer nope"}, {"x-admin-key": ADMIN_KEY + "x"}):
        async with http.get(gw.url + "/admin/endpoints", headers=headers) as resp:
            assert resp.status == 401
            body = await resp.json()
            assert body["error"]["type"] == "authentication_error"
    async with http.get(gw.url + "/admin/endpoints", headers={"x-admin-key": ADMIN_KEY}) as resp:
        assert resp.status == 200
        rows = (await resp.json())["endpoints"]
    assert [r["source"] for r in rows] == ["config"]


async def test_add_drain_and_remove_an_endpoint_live(start_upstream, start_gateway, http):
    first, second = await start_upstream(), await start_upstream()
    gw = await start_gateway([first.url], auth=AUTH, policy="round-robin")

    async with http.post(gw.url + "/admin/endpoints", json={"url": second.url}, headers=ADMIN) as resp:
        assert resp.status == 201
        row = await resp.json()
    assert row["source"] == "admin" and row["url"] == second.url
    # Probed at once, not at the next health round (interval 0.5 s in tests).
    await wait_until(
        lambda: _healthy(http, gw, second.url), 0.4, "the added endpoint to be probed and healthy"
    )
    served = set()
    for _ in range(4):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200
            served.add(resp.headers["x-gateway-endpoint"])
    assert served == {first.name, second.name}

    # Drain the new one while a stream is running on it: the stream finishes, nothing new goes there.
    second.mode = "gated"
    stream_task = None
    for _ in range(2):  # round-robin: one of the next two lands on `second`
        task = asyncio.create_task(_stream(http, gw))
        await asyncio.sleep(0.1)
        if second.first_chunk_sent.is_set():
            stream_task = task
            break
        await task
    assert stream_task is not None
    async with http.post(gw.url + "/admin/endpoints/drain", json={"url": second.url}, headers=ADMIN) as resp:
        assert resp.status == 200
        assert (await resp.json())["draining"] is True
    before = len(second.requests)
    for _ in range(4):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.headers["x-gateway-endpoint"] == first.name
    assert len(second.requests) == before

    # Removing it now leaves the running stream alone; it completes with every chunk.
    async with http.delete(gw.url + "/admin/endpoints", params={"url": second.url}, headers=ADMIN) as resp:
        assert resp.status == 200
        assert (await resp.json())["removed"]["in_flight"] == 1
    assert second.url not in await debug_endpoints(http, gw)
    second.gate.set()
    status, text = await stream_task
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    assert sum(e.in_flight for e in gw.state.registry) == 0


async def test_admin_input_errors(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth=AUTH)
    cases = [
        ("post", "/admin/endpoints", {"url": "ftp://x"}, 400),
        ("post", "/admin/endpoints", {"url": upstream.url}, 409),  # already there, from config
        ("post", "/admin/endpoints", {"url": "http://127.0.0.1:9", "role": "boss"}, 400),
        ("post", "/admin/endpoints/drain", {"url": "http://127.0.0.1:1"}, 404),
        ("post", "/admin/endpoints/drain", {}, 400),
        ("delete", "/admin/endpoints", {"url": upstream.url}, 409),  # config endpoints: drain instead
    ]
    for method, path, body, status in cases:
        async with http.request(method, gw.url + path, json=body, headers=ADMIN) as resp:
            assert resp.status == status, (path, body, await resp.text())
            error = (await resp.json())["error"]
            assert error["message"] and error["type"] and error["code"]
    async with http.post(gw.url + "/admin/endpoints", data=b"{nope", headers=ADMIN) as resp:
        assert resp.status == 400
    assert list(await debug_endpoints(http, gw)) == [upstream.url]


async def _healthy(http, gw, url: str) -> bool:
    rows = await debug_endpoints(http, gw)
    return url in rows and rows[url]["healthy"]


async def _stream(http, gw) -> tuple[int, str]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        return resp.status, (await resp.read()).decode()


async def test_changes_are_refused_when_several_workers_each_hold_a_fleet_view(
    start_upstream, start_gateway, http
):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth=AUTH, server={"workers": 2})
    async with http.post(
        gw.url + "/admin/endpoints/drain", json={"url": upstream.url}, headers=ADMIN
    ) as resp:
        assert resp.status == 409
        assert (await resp.json())["error"]["code"] == "not_supported_with_workers"
    async with http.get(gw.url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200  # reading is fine
    assert not gw.state.registry.get(upstream.url).draining
