"""With auth on, a session id is the tenant's own: another tenant's same id is another session.

Reviewer finding: pins were keyed by the client's id alone, so tenant B sending A's
``x-session-id`` (or a ``user`` value that collides: end-user ids do) followed A's pin and,
with a model only the other replica serves, moved A's conversation there. Real gateway,
real replicas over sockets.
"""

from __future__ import annotations

import pytest
import yaml

from gateway.auth import hash_key
from tests.support.harness import wait_until

KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b"}


def _keys_file(tmp_path) -> str:
    path = tmp_path / "keys.yaml"
    keys = [{"sha256": hash_key(key), "tenant": tenant} for tenant, key in KEYS.items()]
    path.write_text(yaml.safe_dump({"tenants": {"a": {}, "b": {}}, "keys": keys}))
    return str(path)


@pytest.mark.parametrize("source", ["header", "user"])
async def test_another_tenant_with_the_same_session_id_does_not_move_the_pin(
    start_upstream, start_gateway, http, tmp_path, source
) -> None:
    first, second = (
        await start_upstream(("tiny", "only-first")),
        await start_upstream(("tiny", "only-second")),
    )
    only_on = {first.name: "only-first", second.name: "only-second"}
    gw = await start_gateway(
        [first.url, second.url],
        policy="session-aware",
        auth={"enabled": True, "keys_file": _keys_file(tmp_path)},
    )

    async def healthy() -> bool:
        return all(e.healthy and e.models for e in gw.state.registry)

    await wait_until(healthy, 5.0, "both replicas healthy with their models")

    async def turn(tenant: str, model: str = "tiny") -> str:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        headers = {"authorization": f"Bearer {KEYS[tenant]}"}
        if source == "header":
            headers["x-session-id"] = "conv-1"
        else:
            body["user"] = "conv-1"
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["x-gateway-endpoint"]

    home = await turn("a")
    assert [await turn("a") for _ in range(3)] == [home] * 3
    other = next(name for name in only_on if name != home)
    assert await turn("b", only_on[other]) == other  # B's session "conv-1" now lives there
    assert [await turn("a") for _ in range(3)] == [home] * 3  # old: A followed B's pin
    assert await turn("b") == other  # and B's own session sticks where B's went
