"""The hook that learns where a Responses API response is stored: its id → the replica (and tenant).

Read from the head of the answer (the JSON body's ``id``, or a stream's
``response.created`` event) at the first byte, so a client that cancels or retrieves a
response while it is still streaming already finds it.
"""

from __future__ import annotations

from gateway.fleet.endpoint import Endpoint
from gateway.proxy.hooks import RequestHooks
from gateway.request.parse import session_key
from gateway.request.types import ApiKind, InferenceRequest
from gateway.sessions.affinity import SessionAffinity
from gateway.sessions.responses import ResponseRecord, response_id_in

__all__ = ["ResponseHook"]


class ResponseHook(RequestHooks):
    """Records each response with its tenant when auth is on (``scoped``; the stateful routes
    check it, :mod:`gateway.http.responses`), else with none: with auth off
    ``request.tenant`` is the placeholder ``"default"``, which must not make the response the
    property of a tenant that happens to be named so once auth is turned on."""

    def __init__(self, sessions: SessionAffinity, *, scoped: bool = False) -> None:
        self._sessions = sessions  # its store is read per response: a worker's is replaced by
        self._scoped = scoped  # the one that broadcasts (gateway.sessions.response_broadcast)

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        if request.api is not ApiKind.RESPONSES or not request.context.answer_head:
            return
        if request.body.get("store") is False:
            return  # no replica keeps it: a record would only push a stored chain's out
        response_id = response_id_in(request.context.answer_head)
        if response_id is None:
            return
        # The chain is a session: the one the request already belongs to, else this response's own.
        chain = request.session_id or session_key(response_id)
        tenant = request.tenant if self._scoped else None
        self._sessions.responses.put(response_id, ResponseRecord(endpoint.name, chain, tenant))
