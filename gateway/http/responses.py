"""The Responses API's stateful side: a response lives on the replica that made it.

- ``POST /v1/responses`` with ``previous_response_id`` is scheduled on that response's
  replica only (:func:`stored_replica`); its session is the chain's.
- ``GET``/``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and
  ``GET /v1/responses/{id}/input_items`` are passed to that replica as they are.

A response belongs to the tenant that made it (recorded by
:class:`~gateway.proxy.response_hook.ResponseHook`, checked by
:meth:`~gateway.sessions.responses.ResponseRecord.visible_to`): for any other tenant every
one of these calls answers exactly as for an id that does not exist — the same 404, and no
replica asked — so a tenant that learned another's response id can neither read, delete,
cancel nor continue it, nor tell that it exists.

Where the gateway has no record of an id (another gateway instance without Redis, a
restart), and auth is off, the healthy replicas are asked once (``GET
/v1/responses/{id}``) and the one that has it is recorded. With auth on they are not asked
(see :func:`_probe`): several instances need ``sessions.backend: redis`` (the workers of one
instance share their records: :mod:`gateway.sessions.response_broadcast`). A
replica that stored the response but is gone or unhealthy is a 409 naming it — never a
random replica's 404.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from urllib.parse import quote

import aiohttp
from aiohttp import web

from gateway.errors import BadRequest, Conflict, NotFound, UpstreamError, quoted
from gateway.fleet.endpoint import Endpoint, Role
from gateway.http.middleware import REQUEST_ID
from gateway.http.state import STATE, GatewayState
from gateway.proxy.sse import error_event
from gateway.request.parse import CHAIN_SOURCE, session_key, session_sources
from gateway.request.types import ApiKind, InferenceRequest
from gateway.sessions.responses import ResponseRecord

__all__ = ["add_response_routes", "check_continues", "replica_did_not_answer", "stored_replica"]

log = logging.getLogger(__name__)

_SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("responses_session", aiohttp.ClientSession)
_PROBE_TIMEOUT_S = 2.0
# What a response id may be (vLLM: resp_<hex>): a path segment of its own, never "." or "..".
_RESPONSE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,255}")


def _usable(endpoint: Endpoint) -> bool:
    # A draining replica still holds its responses: continuing a chain there is allowed.
    return endpoint.healthy and not endpoint.ejected


def _by_name(state: GatewayState, name: str) -> Endpoint | None:
    # a data-parallel replica's ranks are routed, the replica itself only probed
    return next((e for e in (*state.registry.targets(), *state.registry) if e.name == name), None)


def _caller(state: GatewayState, tenant: str) -> str | None:
    """The tenant a lookup is made for: None with auth off (no tenants: nothing is scoped)."""
    return tenant if state.auth is not None else None


async def _probe(state: GatewayState, response_id: str, request_id: str) -> ResponseRecord | None:
    """Ask every healthy replica whether it stores ``response_id``; record the one that does.

    Only with auth off, where the record has no tenant and none is needed. With auth on a
    response without a record has no known owner — the replicas store no tenant — and
    recording it for whoever asks first would let a tenant that learned another's id take
    the response over (and lock its owner out) once its record is gone: a restart or an
    expired record of the memory store, a Redis outage. So with auth on an unrecorded id is
    answered as unknown, the same 404, and the replicas are not asked.
    """
    session = state.side_client
    if session is None or state.auth is not None:
        return None
    replicas = [e for e in state.registry if _usable(e) and e.role is not Role.PREFILL]

    async def has(endpoint: Endpoint) -> bool:
        try:
            async with session.get(
                f"{endpoint.base_url}/v1/responses/{quote(response_id, safe='')}",
                headers=_headers(endpoint, request_id),
                timeout=aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S),
            ) as answer:
                return answer.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    found = await asyncio.gather(*(has(e) for e in replicas))
    for endpoint, ok in zip(replicas, found, strict=True):
        if ok:
            record = ResponseRecord(endpoint.name, session_key(response_id))
            state.sessions.responses.put(response_id, record)
            return record
    return None


async def _record(
    state: GatewayState, response_id: str, request_id: str, param: str | None, tenant: str | None
) -> ResponseRecord:
    """The record of ``response_id`` as ``tenant`` (None: auth off) may see it, else the 404.

    Another tenant's record is answered exactly as an unknown id — same body, same metric
    (``not_found``) — and never sends the replicas a probe for an id that is recorded."""
    if not _RESPONSE_ID.fullmatch(response_id):  # never probed: "../../metrics" walked the replica
        record, result = None, "not_found"
    else:
        record = await state.sessions.responses.get(response_id)
        result = "hit"
        if record is not None and not record.visible_to(tenant):
            record, result = None, "not_found"  # recorded, for another tenant: not probed either
    if record is None and result == "hit":
        record = await _probe(state, response_id, request_id)
        result = "probed"
    if record is None:
        result = "not_found"
    if state.routes is not None:
        state.routes.lookup(result)
    if record is None:
        raise NotFound(
            # OpenAI's words; says nothing of who owns it
            f"Response with id {quoted(response_id)} not found.",
            param=param,
            code="response_not_found",
        )
    return record


def _replica(state: GatewayState, record: ResponseRecord, response_id: str) -> Endpoint:
    endpoint = _by_name(state, record.endpoint)
    if endpoint is None or not _usable(endpoint):
        if state.routes is not None:
            state.routes.lookup("replica_unavailable")
        why = "has left the fleet" if endpoint is None else "is unhealthy"
        raise Conflict(
            f"Response {quoted(response_id)} is stored on replica {record.endpoint}, which {why}: "
            "the stored response's replica is unavailable (start a new conversation, or retry later)",
            code="response_replica_unavailable",
        )
    return endpoint


async def stored_replica(state: GatewayState, request: InferenceRequest) -> Endpoint | None:
    """For a Responses request with ``previous_response_id``: the replica that stored it.

    With auth on, a client may not choose the new response's id (vLLM's ``request_id`` extra
    field becomes it): one tenant naming another's id would overwrite that response on the
    replica and take over its record here."""
    if request.api is not ApiKind.RESPONSES:
        return None
    if state.auth is not None and "request_id" in request.body:
        raise BadRequest(
            "'request_id' cannot be set by the client when the gateway authenticates: response ids"
            " are chosen by the engine, so that no tenant can name another's",
            param="request_id",
        )
    previous = request.body.get("previous_response_id")
    if not isinstance(previous, str) or not previous:
        return None
    caller = _caller(state, request.tenant)  # set by the auth's authorize before this is called
    record = await _record(state, previous, request.request_id, "previous_response_id", caller)
    if request.session_id is None and CHAIN_SOURCE in session_sources(state.parse_options):
        request.session_id = record.chain  # a previous_response_id chain is one session
    return _replica(state, record, previous)


def check_continues(stored: Endpoint, request: InferenceRequest) -> None:
    """A chain continues only on the replica that stores it: one that does not serve the model
    asked for (after aliases) is a 409, not the retryable 503 the scheduler would answer."""
    if not stored.serves(request.model):
        served = ", ".join(quoted(m) for m in sorted(stored.models)[:8])
        raise Conflict(
            f"Response {quoted(request.body.get('previous_response_id'))} is stored on replica"
            f" {stored.name}, which does not serve model {quoted(request.model)} (it serves"
            f" {served or 'no model'}): continue the conversation with one of those, or start a new one",
            param="model",
            code="response_replica_lacks_model",
        )


def _headers(endpoint: Endpoint, request_id: str) -> dict[str, str]:
    headers = {"x-request-id": request_id}
    if endpoint.auth_header is not None:
        headers["authorization"] = endpoint.auth_header
    return headers


async def _pass_through(http_request: web.Request) -> web.StreamResponse:
    """One stateful call, sent to the replica that stores the response, answered as it answers."""
    state = http_request.app[STATE]
    tenant = await state.auth.authenticate(http_request.headers) if state.auth is not None else None
    response_id = http_request.match_info["response_id"]
    request_id = http_request[REQUEST_ID]
    caller = tenant.name if tenant is not None else None
    record = await _record(state, response_id, request_id, None, caller)
    endpoint = _replica(state, record, response_id)
    session = http_request.app[_SESSION]
    headers = _headers(endpoint, request_id)
    body = await http_request.read() if http_request.can_read_body else None
    if body is not None:
        headers["content-type"] = http_request.headers.get("content-type", "application/json")
    # the route's own path with the (validated, quoted) id, never the client's decoded path
    suffix = http_request.match_info.route.resource.canonical.rsplit("}", 1)[1]  # "", /cancel …
    url = f"{endpoint.base_url}/v1/responses/{quote(response_id, safe='')}{suffix}"
    if http_request.rel_url.query_string:
        url += "?" + http_request.rel_url.raw_query_string
    timeouts = state.config.timeouts
    try:
        async with asyncio.timeout(timeouts.first_byte_s):  # the answer's head: first_byte_s, as proxied
            answer = await session.request(
                http_request.method,
                url,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeouts.total_s, sock_connect=timeouts.connect_s),
            )
        async with answer:
            out = {"x-gateway-endpoint": endpoint.name, "x-request-id": request_id}
            content_type = answer.headers.get("content-type", "application/json")
            if http_request.method == "DELETE" and answer.status == 200:
                state.sessions.responses.forget(response_id)
            if not content_type.startswith("text/event-stream"):
                out["content-type"] = content_type
                body = await _read_bounded(
                    answer, state.config.limits.max_response_bytes, endpoint, timeouts.idle_s
                )
                return web.Response(status=answer.status, body=body, headers=out)
            response = web.StreamResponse(status=answer.status, headers={**out, "content-type": content_type})
            await response.prepare(http_request)
            try:
                async for chunk in _chunks(answer, timeouts.idle_s):
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:  # committed: end it in-band
                why = str(exc) or f"no data within {timeouts.idle_s:g} s"  # a TimeoutError says nothing
                log.info("request %s: %s broke mid-stream: %s", request_id, endpoint.name, why)
                message = f"replica {endpoint.name} broke the stream: {why}"
                await response.write(error_event(message, mid_event=True, api=ApiKind.RESPONSES))
            await response.write_eof()
            return response
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.info(
            "request %s: %s %s on %s failed: %s", request_id, http_request.method, url, endpoint.name, exc
        )
        raise replica_did_not_answer(response_id, endpoint) from None


def replica_did_not_answer(response_id: str, endpoint: Endpoint) -> Conflict:
    """The 409 for a stored response whose replica could not be reached (it is the only one
    that holds it: no other replica is worth trying, and none is "unavailable for the model")."""
    return Conflict(
        f"Response {quoted(response_id)} is stored on replica {endpoint.name}, which did not answer: "
        "the stored response's replica is unavailable",
        code="response_replica_unavailable",
    )


async def _chunks(answer: aiohttp.ClientResponse, idle_s: float) -> AsyncIterator[bytes]:
    """The answer's body as it comes; a replica silent for ``idle_s`` raises TimeoutError."""
    while True:
        async with asyncio.timeout(idle_s):
            chunk = await answer.content.readany()
        if not chunk:
            return
        yield chunk


async def _read_bounded(
    answer: aiohttp.ClientResponse, limit: int, endpoint: Endpoint, idle_s: float
) -> bytes:
    """The replica's whole answer, refused (502) past ``limit``: one must not fill memory."""
    parts, size = [], 0
    async for chunk in _chunks(answer, idle_s):
        size += len(chunk)
        if size > limit:
            raise UpstreamError(f"replica {endpoint.name}'s answer is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    # Bodies pass through as the replica sent them, so ask for them uncompressed: a replica
    # behind a compressing proxy otherwise answered gzip that reached the client undeclared.
    session = aiohttp.ClientSession(auto_decompress=False, headers={"accept-encoding": "identity"})
    app[_SESSION] = session
    app[STATE].side_client = session
    yield
    await session.close()


def add_response_routes(app: web.Application) -> None:
    """The stateful routes (the ``POST /v1/responses`` route itself is an inference route)."""
    app.router.add_get("/v1/responses/{response_id}", _pass_through)
    app.router.add_delete("/v1/responses/{response_id}", _pass_through)
    app.router.add_post("/v1/responses/{response_id}/cancel", _pass_through)
    app.router.add_get("/v1/responses/{response_id}/input_items", _pass_through)
    app.cleanup_ctx.append(_client_session)
