"""POST /admin/endpoints naming a configured replica without its user info: the replica is
already in the fleet (one endpoint per replica), so the answer is a 409 and the admin source
keeps no shadow entry. Found by the final review (2026-12-05): a 500."""

from __future__ import annotations

from tests.web.test_admin import ADMIN, AUTH


async def test_admin_add_of_a_configured_replica_in_another_spelling(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    port = int(upstream.url.rsplit(":", 1)[1])
    configured = f"http://svc:secret@127.0.0.1:{port}"
    gw = await start_gateway([configured], auth=AUTH)
    plain = {"url": f"http://127.0.0.1:{port}"}
    async with http.post(gw.url + "/admin/endpoints", json=plain, headers=ADMIN) as resp:
        status, text = resp.status, await resp.text()
    assert status == 409, f"{status}: {text}"
    assert gw.state.membership.endpoints_of("admin") == []
