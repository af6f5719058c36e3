"""A JSON body nested past the interpreter's recursion limit is a 400 on every admin route that
reads one, not a 500 with a traceback (found by review, 2026-12-05)."""

from __future__ import annotations

from tests.support.edge_cases import ADMIN, ADMIN_SHA

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_FIELD = b'{"url": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


async def test_deeply_nested_admin_bodies_are_400(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth={"admin_key_sha256": ADMIN_SHA})
    calls = [
        ("post", "/admin/endpoints"),
        ("post", "/admin/endpoints/drain"),
        ("post", "/admin/endpoints/undrain"),
        ("delete", "/admin/endpoints"),
    ]
    for method, path in calls:
        for body in (DEEP, DEEP_FIELD):
            async with http.request(method, gw.url + path, data=body, headers=ADMIN) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400, (method, path, resp.status, error)
                assert error["code"] == "invalid_admin_request", error
    assert [e.url for e in gw.state.registry] == [upstream.url]
