"""Response id → replica: reading the id from an answer's head, and the memory store's bounds."""

from __future__ import annotations

import json

from gateway.sessions.responses import MemoryResponseStore, ResponseRecord, response_id_in


def test_id_from_a_json_body_and_from_response_created():
    body = json.dumps({"id": "resp_1", "object": "response", "output": [{"id": "msg_2"}]}).encode()
    assert response_id_in(body) == "resp_1"
    created = {"type": "response.created", "response": {"id": "resp_3", "output": []}}
    stream = b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n"
    assert response_id_in(stream) == "resp_3"
    assert response_id_in(b"event: response.in_progress\ndata: {}\n\n") is None
    assert response_id_in(b"event: response.created\ndata: {not json\n\n") is None


async def test_memory_store_is_bounded_and_forgets():
    store = MemoryResponseStore(ttl_s=60, max_entries=2)
    for i in range(3):
        store.put(f"resp_{i}", ResponseRecord(f"r{i}", "chain"))
    assert await store.get("resp_0") is None  # the oldest went first
    assert (await store.get("resp_2")).endpoint == "r2"
    store.forget("resp_2")
    assert await store.get("resp_2") is None and len(store) == 1


async def test_memory_store_expires():
    store = MemoryResponseStore(ttl_s=1e-9, max_entries=10)
    store.put("resp_x", ResponseRecord("r", "c"))
    assert await store.get("resp_x") is None


def test_a_record_is_visible_to_its_tenant_only_when_auth_is_on():
    owned = ResponseRecord("r", "c", tenant="a")
    assert owned.visible_to("a") and not owned.visible_to("b")
    assert owned.visible_to(None)  # auth off: no tenants, nothing to scope
    legacy = ResponseRecord("r", "c")  # no tenant: made with auth off, or before tenants were recorded
    assert legacy.tenant is None and legacy.visible_to(None)
    assert not legacy.visible_to("a") and not legacy.visible_to("default")  # fail closed
