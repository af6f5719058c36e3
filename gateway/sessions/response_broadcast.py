"""The memory response store of one worker, kept in step with its siblings' by broadcast.

Why: the kernel spreads a client's connections over the workers, so a Responses chain's
next call (``previous_response_id``, ``GET /v1/responses/{id}``) lands on any worker. With
auth off an unknown id is found by asking the replicas; with auth on it is not (its owner
cannot be told, :mod:`gateway.http.responses`), so every worker must know each response
and its tenant. Each ``put`` and ``forget`` is also sent to the siblings as one small unix
datagram (:class:`~gateway.ops.sibling_socket.SiblingMessages`) and applied there to their
own store. A full receive buffer drops it (counted): that worker then answers the id as
unknown, as after a restart. A worker started in place of a dead one asks a sibling for
every record it holds (:class:`~gateway.ops.catch_up.CatchUp`). With ``sessions.backend:
redis`` the store is shared already and this is not used.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gateway.ops.catch_up import CatchUp
from gateway.ops.sibling_socket import SiblingMessages
from gateway.sessions.responses import MemoryResponseStore, ResponseRecord

__all__ = ["BroadcastResponseStore"]

_MAX_DATAGRAM = 4096  # an id (≤ 256), a replica's name, a chain key and a tenant
_FORGOTTEN_KEPT = 100_000  # deletes remembered while catching up (a sibling's file may predate them)


class BroadcastResponseStore:
    """A :class:`MemoryResponseStore` whose changes also reach the sibling workers
    (``ResponseStore`` contract)."""

    def __init__(
        self,
        local: MemoryResponseStore,
        directory: str,
        worker: int,
        workers: int,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.local = local
        self._siblings = SiblingMessages(directory, "responses", worker, workers, _MAX_DATAGRAM, on_drop)
        # newest first: each is restored as older than the ones before it
        self.catch_up = CatchUp(
            self._siblings, local.ids_newest_first, self._encode, self._restore, on_done=self._caught_up
        )
        # while catching up: the ids deleted since (a sibling's file may still hold them)
        self._forgotten: OrderedDict[str, None] | None = None

    def start(self, catch_up: bool = False) -> None:
        """Listen to the siblings; ``catch_up`` (a replacement worker): ask them for their records."""
        self._siblings.listen(self._receive)
        if catch_up:
            self._forgotten = OrderedDict()
            self.catch_up.request()

    async def get(self, response_id: str) -> ResponseRecord | None:
        return self.local.get_now(response_id)

    def put(self, response_id: str, record: ResponseRecord) -> None:
        self.local.put(response_id, record)
        self._siblings.send({"id": response_id, "e": record.endpoint, "c": record.chain, "t": record.tenant})

    def forget(self, response_id: str) -> None:
        self._forget_here(response_id)
        self._siblings.send({"id": response_id})

    def _forget_here(self, response_id: str) -> None:
        self.local.forget(response_id)
        forgotten = self._forgotten
        if forgotten is not None:
            forgotten[response_id] = None
            if len(forgotten) > _FORGOTTEN_KEPT:
                forgotten.popitem(last=False)

    async def close(self) -> None:
        await self.catch_up.close()
        self._siblings.close()
        await self.local.close()

    def _encode(self, response_id: str) -> list[Any] | None:
        entry = self.local.entry(response_id)
        if entry is None:  # gone since the ids were copied
            return None
        record, expires = entry
        return [response_id, record.endpoint, record.chain, record.tenant, expires]

    def _caught_up(self) -> None:
        self._forgotten = None  # a sibling's file is applied: no older copy of a record comes any more

    def _restore(self, row: list[Any]) -> None:
        response_id, endpoint, chain, tenant, expires = row
        if not isinstance(response_id, str) or not isinstance(endpoint, str) or not isinstance(chain, str):
            raise TypeError("record")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError("tenant")
        if not isinstance(expires, float) or expires > time.monotonic() + self.local.ttl_s:
            raise ValueError("expiry")
        if self._forgotten is not None and response_id in self._forgotten:
            return  # deleted after the sibling wrote its file
        self.local.restore(response_id, ResponseRecord(endpoint, chain, tenant), expires)

    def _receive(self, message: dict[str, Any]) -> None:
        if self.catch_up.handle(message):
            return
        response_id = message["id"]
        if not isinstance(response_id, str):
            raise TypeError("id")
        if "e" not in message:
            self._forget_here(response_id)
            return
        endpoint, chain, tenant = message["e"], message["c"], message["t"]
        if not isinstance(endpoint, str) or not isinstance(chain, str):
            raise TypeError("record")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError("tenant")
        self.local.put(response_id, ResponseRecord(endpoint, chain, tenant))
