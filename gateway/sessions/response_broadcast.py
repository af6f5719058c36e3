"""The memory response store of one worker, kept in step with its siblings' by broadcast.

Why: the kernel spreads a client's connections over the workers, so a Responses chain's
next call (``previous_response_id``, ``GET /v1/responses/{id}``) lands on any worker. With
auth off an unknown id is found by asking the replicas; with auth on it is not (its owner
cannot be told, :mod:`gateway.http.responses`), so every worker must know each response
and its tenant. Each ``put`` and ``forget`` is also sent to the siblings as one small unix
datagram (:class:`~gateway.ops.sibling_socket.SiblingMessages`) and applied there to their
own store. A full receive buffer drops it (counted): that worker then answers the id as
unknown, as after a restart. With ``sessions.backend: redis`` the store is shared already
and this is not used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.ops.sibling_socket import SiblingMessages
from gateway.sessions.responses import MemoryResponseStore, ResponseRecord

__all__ = ["BroadcastResponseStore"]

_MAX_DATAGRAM = 4096  # an id (≤ 256), a replica's name, a chain key and a tenant


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

    def start(self) -> None:
        self._siblings.listen(self._receive)

    async def get(self, response_id: str) -> ResponseRecord | None:
        return self.local.get_now(response_id)

    def put(self, response_id: str, record: ResponseRecord) -> None:
        self.local.put(response_id, record)
        self._siblings.send({"id": response_id, "e": record.endpoint, "c": record.chain, "t": record.tenant})

    def forget(self, response_id: str) -> None:
        self.local.forget(response_id)
        self._siblings.send({"id": response_id})

    async def close(self) -> None:
        self._siblings.close()
        await self.local.close()

    def _receive(self, message: dict[str, Any]) -> None:
        response_id = message["id"]
        if not isinstance(response_id, str):
            raise TypeError("id")
        if "e" not in message:
            self.local.forget(response_id)
            return
        endpoint, chain, tenant = message["e"], message["c"], message["t"]
        if not isinstance(endpoint, str) or not isinstance(chain, str):
            raise TypeError("record")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError("tenant")
        self.local.put(response_id, ResponseRecord(endpoint, chain, tenant))
