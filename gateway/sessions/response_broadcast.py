"""The memory response store of one worker, kept in step with its siblings' by broadcast.

Why: the kernel spreads a client's connections over the workers, so a Responses chain's
next call (``previous_response_id``, ``GET /v1/responses/{id}``) lands on any worker. With
auth off an unknown id is found by asking the replicas; with auth on it is not (its owner
cannot be told, :mod:`gateway.http.responses`), so every worker must know each response
and its tenant. Each ``put`` and ``forget`` is also sent to the siblings as one small unix
datagram (:class:`~gateway.ops.sibling_socket.SiblingSocket`) and applied there to their
own store. A full receive buffer drops it (counted): that worker then answers the id as
unknown, as after a restart. With ``sessions.backend: redis`` the store is shared already
and this is not used.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from gateway.ops.sibling_socket import SiblingSocket
from gateway.sessions.responses import MemoryResponseStore, ResponseRecord

__all__ = ["BroadcastResponseStore"]

log = logging.getLogger(__name__)

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
        self._socket = SiblingSocket(directory, "responses", worker, workers, _MAX_DATAGRAM)
        self._on_drop = on_drop

    def start(self) -> None:
        self._socket.listen(self._receive)

    async def get(self, response_id: str) -> ResponseRecord | None:
        return self.local.get_now(response_id)

    def put(self, response_id: str, record: ResponseRecord) -> None:
        self.local.put(response_id, record)
        self._send({"id": response_id, "e": record.endpoint, "c": record.chain, "t": record.tenant})

    def forget(self, response_id: str) -> None:
        self.local.forget(response_id)
        self._send({"id": response_id})

    async def close(self) -> None:
        self._socket.close()
        await self.local.close()

    def _send(self, message: dict[str, str | None]) -> None:
        datagram = json.dumps(message, separators=(",", ":")).encode()
        if len(datagram) > _MAX_DATAGRAM:
            failed = 1  # never the case for ids the routes accept: counted, not sent
        else:
            failed = self._socket.send(datagram)
        if failed and self._on_drop is not None:
            for _ in range(failed):
                self._on_drop()

    def _receive(self, datagram: bytes) -> None:
        try:
            message = json.loads(datagram)
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
        except (ValueError, KeyError, TypeError):  # only siblings can write here
            log.warning("response-store broadcast: a malformed datagram was dropped")
            return
        self.local.put(response_id, ResponseRecord(endpoint, chain, tenant))
