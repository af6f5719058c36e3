"""Responses API state: which replica stored a response, and the session of its chain.

vLLM keeps Responses API objects in the process that made them
(``VLLM_ENABLE_RESPONSES_API_STORE=1``): a request with ``previous_response_id`` and every
``/v1/responses/{id}`` call must reach that replica. The gateway records
``response id → (replica, chain session)`` from each answer and routes by it.

Two stores behind one protocol, as for session pins (:mod:`gateway.sessions.store`): in
memory (bounded LRU with a TTL) and Redis (shared by gateway instances, mirrored locally,
answered from the local copy when Redis is slow or down).

A record also names the tenant that made the response: a response belongs to the tenant
(API key's tenant) that created it, as OpenAI scopes responses to their project, and
another tenant is answered as if the id did not exist (:meth:`ResponseRecord.visible_to`).
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from gateway.sessions.redis_mirror import MirroredStore

__all__ = [
    "MemoryResponseStore",
    "RedisResponseStore",
    "ResponseRecord",
    "ResponseStore",
    "response_id_in",
]


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    endpoint: str  # the replica's name (its URL without the scheme, as in the registry)
    chain: str  # the session key of the chain: the first response's, kept along the chain
    # The tenant that made the response; None when none is known: made with auth off, or a
    # legacy record written by a gateway that did not record tenants.
    tenant: str | None = None

    def visible_to(self, tenant: str | None) -> bool:
        """Whether a caller may see (use, continue, delete) this response.

        ``tenant`` is the caller's tenant, None when auth is off: with no tenants there is
        nothing to scope, and every response is visible. An authenticated tenant sees only
        the responses its own tenant made. A record without a tenant (made while auth was
        off, or a legacy record from before tenants were recorded) is no tenant's, so with
        auth on it is visible to nobody — fail closed: its owner cannot be told from anyone
        else who learned the id, and letting every tenant in would keep the leak open for
        the record's TTL. Such a response is answered as unknown (its chain starts over).
        """
        return tenant is None or self.tenant == tenant


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> ResponseRecord | None: ...

    def put(self, response_id: str, record: ResponseRecord) -> None:
        """Record (never waits: remote writes run later)."""
        ...

    def forget(self, response_id: str) -> None:
        """The response was deleted."""
        ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """Records as plain tuples of strings and a float, not as :class:`ResponseRecord` objects:
    the garbage collector stops tracking such tuples, and a full collection with a million
    records held the event loop ~300 ms with records, ~60 ms with tuples."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        # id → (endpoint, chain, tenant, expires on time.monotonic())
        self._entries: OrderedDict[str, tuple[str, str, str | None, float]] = OrderedDict()

    def get_now(self, response_id: str) -> ResponseRecord | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[3] < time.monotonic():
            del self._entries[response_id]
            return None
        return ResponseRecord(entry[0], entry[1], entry[2])

    async def get(self, response_id: str) -> ResponseRecord | None:
        return self.get_now(response_id)

    def put(self, response_id: str, record: ResponseRecord) -> None:
        expires = time.monotonic() + self.ttl_s
        self._entries[response_id] = (record.endpoint, record.chain, record.tenant, expires)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    def ids_newest_first(self) -> list[str]:
        """Every id, most recent first (a copy of references only: no entry is copied)."""
        return list(reversed(self._entries))

    def entry(self, response_id: str) -> tuple[ResponseRecord, float] | None:
        """The record and its expiry (on ``time.monotonic()``), as stored, expired or not."""
        entry = self._entries.get(response_id)
        return None if entry is None else (ResponseRecord(entry[0], entry[1], entry[2]), entry[3])

    def restore(self, response_id: str, record: ResponseRecord, expires: float) -> bool:
        """An older entry from elsewhere (a sibling worker's), kept unless this store has the id
        or is full; it goes in as less recent than every entry here. Whether it was kept."""
        if response_id in self._entries or len(self._entries) >= self._max or expires < time.monotonic():
            return False
        self._entries[response_id] = (record.endpoint, record.chain, record.tenant, expires)
        self._entries.move_to_end(response_id, last=False)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        self._entries.clear()


class RedisResponseStore(MirroredStore[MemoryResponseStore]):
    """Keys ``<prefix>:response:{<id>}`` → ``{"e": endpoint, "c": chain, "t": tenant}`` with
    ``PX ttl`` (the Redis side is :class:`~gateway.sessions.redis_mirror.RedisMirror`, shared
    with the session store). ``"t"`` is left out when the record has no tenant, so such a
    record is written exactly as a legacy one, and a legacy value (no ``"t"``) reads as a
    record without a tenant."""

    kind = "response"

    async def get(self, response_id: str) -> ResponseRecord | None:
        value = await self._redis.get(response_id)
        if value is None:  # Redis down, or our own SET still in flight: the local copy is true
            return self.local.get_now(response_id)
        try:
            data = json.loads(value)
            tenant = data.get("t")
            if tenant is not None and not isinstance(tenant, str):
                raise TypeError("tenant")  # never a tenant made up from a damaged value
            return ResponseRecord(str(data["e"]), str(data["c"]), tenant)
        except (ValueError, KeyError, TypeError, AttributeError):
            return self.local.get_now(response_id)

    def put(self, response_id: str, record: ResponseRecord) -> None:
        self.local.put(response_id, record)
        value = {"e": record.endpoint, "c": record.chain}
        if record.tenant is not None:
            value["t"] = record.tenant
        self._redis.set(response_id, json.dumps(value))

    def forget(self, response_id: str) -> None:
        self.local.forget(response_id)
        self._redis.delete(response_id)


_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_CREATED_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')


def response_id_in(head: bytes) -> str | None:
    """The response id in the head of an answer: a JSON body's top-level ``id`` (vLLM writes
    it first), or the ``response.created`` event that opens a stream (``response.id``)."""
    if head.lstrip().startswith(b"{"):
        found = _ID.search(head)
        return found.group(1).decode() if found else None
    for event in head.split(b"\n\n"):
        if b"response.created" not in event:
            continue
        for line in event.splitlines():
            if line.startswith(b"data:"):
                try:
                    payload = json.loads(line[5:])
                    response_id = payload["response"]["id"]
                except (ValueError, KeyError, TypeError):
                    # Cut by the head's bound (the event echoes the request's instructions and
                    # tools): vLLM writes the response's own id first.
                    found = _CREATED_ID.search(line)
                    return found.group(1).decode() if found else None
                return response_id if isinstance(response_id, str) else None
    return None
