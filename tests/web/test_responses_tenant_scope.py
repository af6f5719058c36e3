"""Stored responses belong to the tenant that made them, over real sockets.

Two tenants' API keys, a Responses replica that stores responses (``tests/support``), the
gateway with either response store: tenant B, holding tenant A's response id, gets from
every stateful call — ``GET``/``DELETE /v1/responses/{id}``, ``…/cancel``, ``…/input_items``
and a ``previous_response_id`` chain — exactly the answer an unknown id gets, and the
replica hears nothing of it (no pass-through, no probe); tenant A is served as before.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml

from gateway.auth import hash_key
from gateway.sessions.responses import ResponseRecord
from tests.prefix.conftest import key_prefix, redis_url
from tests.support.responses_replica import running_replica

__all__ = ["key_prefix", "redis_url"]  # fixtures

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
KEYS = {
    "tenants": {"a": {}, "b": {}},
    "keys": [{"sha256": hash_key(KEY_A), "tenant": "a"}, {"sha256": hash_key(KEY_B), "tenant": "b"}],
}
# The five ways to reach a stored response (see _call)
CALLS = ("get", "delete", "cancel", "input_items", "chain")


def _auth(keys_file: str) -> dict[str, Any]:
    return {"enabled": True, "keys_file": keys_file}


@pytest.fixture
def keys_file(tmp_path) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(KEYS))
    return str(path)


def _sessions(backend: str, redis_url: str, key_prefix: str) -> dict[str, Any]:
    if backend == "memory":
        return {"backend": "memory"}
    return {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix, "redis_budget_s": 0.5}


async def _create(http, gw, key: str | None) -> str:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with http.post(
        gw.url + "/v1/responses", json={"model": "tiny", "input": "hi"}, headers=headers
    ) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["id"]


async def _call(http, gw, key: str | None, call: str, response_id: str) -> tuple[int, Any, str]:
    """One stateful call; returns (status, JSON body, the request id it was sent with)."""
    request_id = f"scope-{uuid.uuid4().hex}"
    headers = {"x-request-id": request_id}
    if key:
        headers["authorization"] = f"Bearer {key}"
    base = f"{gw.url}/v1/responses"
    method, url, body = {
        "get": ("GET", f"{base}/{response_id}", None),
        "delete": ("DELETE", f"{base}/{response_id}", None),
        "cancel": ("POST", f"{base}/{response_id}/cancel", None),
        "input_items": ("GET", f"{base}/{response_id}/input_items", None),
        "chain": ("POST", base, {"model": "tiny", "input": "more", "previous_response_id": response_id}),
    }[call]
    async with http.request(method, url, json=body, headers=headers) as r:
        return r.status, await r.json(), request_id


async def _answers(http, gw, key: str | None, response_id: str, replica) -> dict[str, tuple[int, Any]]:
    """Every call's (status, body); asserts the replica saw none of them (nor a probe)."""
    answers = {}
    for call in CALLS:
        status, body, request_id = await _call(http, gw, key, call, response_id)
        answers[call] = (status, body)
        reached = [(m, p) for m, p, h in replica.seen if h.get("x-request-id") == request_id]
        assert reached == [], f"{call}: the replica was asked {reached}"
    return answers


def _assert_unknown(answers: dict[str, tuple[int, Any]], response_id: str) -> None:
    for call, (status, body) in answers.items():
        assert status == 404, (call, status, body)
        assert body["error"]["code"] == "response_not_found", (call, body)
        assert body["error"]["type"] == "invalid_request_error", (call, body)
        assert body["error"]["message"] == f"Response with id {response_id!r} not found.", (call, body)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_another_tenants_response_is_answered_as_an_unknown_id(
    backend, stack, start_gateway, http, keys_file, redis_url, key_prefix
):
    replica = await stack.enter_async_context(running_replica())
    sessions = _sessions(backend, redis_url, key_prefix)
    gw = await start_gateway([replica.url], auth=_auth(keys_file), sessions=sessions)
    # With Redis, B asks a second gateway that has never seen the response: the tenant must
    # come back from Redis (a gateway that kept it only in its local copy would let B in).
    gw_b = (
        await start_gateway([replica.url], auth=_auth(keys_file), sessions=sessions)
        if backend == "redis"
        else gw
    )

    response_id = await _create(http, gw, KEY_A)
    if backend == "redis":
        await gw.state.sessions.responses.flush()

    foreign = await _answers(http, gw_b, KEY_B, response_id, replica)
    _assert_unknown(foreign, response_id)
    assert response_id in replica.stored  # B's DELETE deleted nothing
    assert (await gw_b.state.sessions.responses.get(response_id)).tenant == "a"

    # Tenant A, through either gateway, still reaches its response on every route.
    for gateway in [gw] if gw_b is gw else [gw, gw_b]:
        for call in ("get", "cancel", "input_items", "chain"):
            status, body, _ = await _call(http, gateway, KEY_A, call, response_id)
            assert status == 200, (call, status, body)
    status, body, _ = await _call(http, gw_b, KEY_A, "delete", response_id)
    assert status == 200 and body["deleted"] is True

    # Now the id is truly unknown: B's answers are the very same bodies (nothing told it apart).
    if backend == "redis":
        await gw_b.state.sessions.responses.flush()
    unknown = await _answers(http, gw_b, KEY_B, response_id, replica)
    assert unknown == foreign
    assert (await _call(http, gw_b, KEY_A, "get", response_id))[:2] == foreign["get"]


async def test_an_unrecorded_id_is_not_probed_for_anyone_with_auth_on(stack, start_gateway, http, keys_file):
    """A restart, or another worker with the memory store: the gateway cannot tell whose it
    is, and recording it for the first tenant that asks would hand it over."""
    replica = await stack.enter_async_context(running_replica())
    gw = await start_gateway([replica.url], auth=_auth(keys_file))
    response_id = await _create(http, gw, KEY_A)
    gw.state.sessions.responses.forget(response_id)

    _assert_unknown(await _answers(http, gw, KEY_B, response_id, replica), response_id)
    assert await gw.state.sessions.responses.get(response_id) is None  # B claimed nothing
    _assert_unknown(await _answers(http, gw, KEY_A, response_id, replica), response_id)  # the cost

    open_gw = await start_gateway([replica.url])  # auth off: no tenants, the replicas are asked
    status, _, _ = await _call(http, open_gw, None, "get", response_id)
    assert status == 200
    assert (await open_gw.state.sessions.responses.get(response_id)).tenant is None


async def test_responses_made_with_store_false_are_not_recorded(stack, start_gateway, http, keys_file):
    """Codex sends ``store: false``: no replica keeps such a response, so a record of it only
    pushed a stored chain's record out of the bounded store — and with auth on an evicted
    record is never looked for again, so the owner's chain became a 404."""
    replica = await stack.enter_async_context(running_replica())
    gw = await start_gateway([replica.url], auth=_auth(keys_file), sessions={"max_responses": 3})
    kept = await _create(http, gw, KEY_A)
    one_offs = []
    for _ in range(3):
        async with http.post(
            gw.url + "/v1/responses",
            json={"model": "tiny", "input": "hi", "store": False},
            headers={"authorization": f"Bearer {KEY_A}"},
        ) as r:
            assert r.status == 200, await r.text()
            one_offs.append((await r.json())["id"])
    for response_id in one_offs:
        assert await gw.state.sessions.responses.get(response_id) is None
    assert (await gw.state.sessions.responses.get(kept)).tenant == "a"
    status, _, _ = await _call(http, gw, KEY_A, "chain", kept)
    assert status == 200


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_legacy_record_without_a_tenant_is_no_tenants(
    backend, stack, start_gateway, http, keys_file, redis_url, key_prefix
):
    """A record written before tenants were recorded (or with auth off) loads, and with auth on
    it is answered as unknown to every tenant — fail closed; with auth off it still routes."""
    replica = await stack.enter_async_context(running_replica())
    async with http.post(replica.url + "/v1/responses", json={"model": "tiny", "input": "old"}) as r:
        response_id = (await r.json())["id"]  # stored on the replica, by an older gateway
    replica_name = replica.url.split("://", 1)[1]
    sessions = _sessions(backend, redis_url, key_prefix)
    gw = await start_gateway([replica.url], auth=_auth(keys_file), sessions=sessions)
    open_gw = await start_gateway([replica.url], sessions=sessions)
    if backend == "redis":  # the old format, exactly as the previous release wrote it
        client = aioredis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
        try:
            legacy = json.dumps({"e": replica_name, "c": "old-chain"})
            await client.set(f"{key_prefix}:response:{{{response_id}}}", legacy, px=60_000)
        finally:
            await client.aclose()
    else:
        for gateway in (gw, open_gw):
            gateway.state.sessions.responses.put(response_id, ResponseRecord(replica_name, "old-chain"))
    assert await gw.state.sessions.responses.get(response_id) == ResponseRecord(replica_name, "old-chain")

    for key in (KEY_A, KEY_B):
        _assert_unknown(await _answers(http, gw, key, response_id, replica), response_id)
    assert response_id in replica.stored

    status, body, _ = await _call(http, open_gw, None, "get", response_id)
    assert status == 200 and body["id"] == response_id


async def test_a_client_cannot_choose_a_response_id_with_auth_on(stack, start_gateway, http, keys_file):
    """vLLM makes the body's ``request_id`` the response's id and stores it over any response of
    that id: tenant B naming tenant A's id would replace A's response and take its record."""
    replica = await stack.enter_async_context(running_replica())
    gw = await start_gateway([replica.url], auth=_auth(keys_file))
    response_id = await _create(http, gw, KEY_A)
    stolen = {"model": "tiny", "input": "mine now", "request_id": response_id}
    async with http.post(
        gw.url + "/v1/responses", json=stolen, headers={"authorization": f"Bearer {KEY_B}"}
    ) as r:
        assert r.status == 400, await r.text()
        error = (await r.json())["error"]
    assert error["param"] == "request_id" and error["type"] == "invalid_request_error"
    assert replica.stored[response_id]["id"] == response_id and len(replica.stored) == 1
    assert (await gw.state.sessions.responses.get(response_id)).tenant == "a"
    assert (await _call(http, gw, KEY_A, "get", response_id))[0] == 200

    open_gw = await start_gateway([replica.url])  # auth off: one tenant, the engine's extra field works
    async with http.post(open_gw.url + "/v1/responses", json={**stolen, "request_id": "resp_mine"}) as r:
        assert r.status == 200 and (await r.json())["id"] == "resp_mine"
